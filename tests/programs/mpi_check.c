/* An MPI program that checks every byte it receives, using the patterns MPI progress engines
 * put on their TCP connections: both sides sending at once (MPI_Sendrecv), non-blocking
 * sends and receives to every peer at once (Isend/Irecv + Waitall), completion found by
 * polling (MPI_Test loops, zero-timeout progress), collectives (Alltoall, Allreduce), and
 * messages from 1 byte to 4 MiB + 3 (eager and rendezvous protocols).
 *
 *     mpi_check SECONDS
 *
 * Repeats the rounds for about SECONDS (at least one round), then each rank prints one JSON
 * line: {"rank", "size", "pid", "rounds", "checked_bytes", "errors"}; "errors" is the sum
 * over all ranks (Allreduce), so every line tells whether the whole run was right. Exit 0
 * when there was no error.
 *
 * Byte i of the message rank s sends to rank d in round k, step t is
 * (s * 131 + d * 31 + k * 17 + t * 7 + i) mod 251.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const int SIZES[] = {1, 7, 64, 1000, 4096, 65536, 262147, 1 << 20, (4 << 20) + 3};
#define NSIZES ((int)(sizeof SIZES / sizeof SIZES[0]))

static unsigned char byte_of(int s, int d, long k, int t, long i) {
    return (unsigned char)(((long)s * 131 + (long)d * 31 + k * 17 + (long)t * 7 + i) % 251);
}

static void fill(unsigned char *b, long n, int s, int d, long k, int t) {
    for (long i = 0; i < n; i++) b[i] = byte_of(s, d, k, t, i);
}

static long check(const unsigned char *b, long n, int s, int d, long k, int t) {
    long bad = 0;
    for (long i = 0; i < n; i++) bad += b[i] != byte_of(s, d, k, t, i);
    return bad;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    long maxn = SIZES[NSIZES - 1];
    unsigned char *sb = malloc((size_t)maxn * size), *rb = malloc((size_t)maxn * size);
    MPI_Request *req = malloc(sizeof(MPI_Request) * 2 * size);
    long errors = 0, checked = 0, k = 0;
    double t0 = MPI_Wtime();
    int go = 1;
    while (go) {
        for (int z = 0; z < NSIZES; z++) {
            long n = SIZES[z];
            int right = (rank + 1) % size, left = (rank + size - 1) % size;
            /* 1: both sides send at once around the ring. */
            fill(sb, n, rank, right, k, 1);
            MPI_Sendrecv(sb, (int)n, MPI_BYTE, right, 1, rb, (int)n, MPI_BYTE, left, 1,
                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            errors += check(rb, n, left, rank, k, 1);
            checked += n;
            /* 2: non-blocking to and from every peer at once, completion by polling. */
            int m = 0;
            for (int p = 0; p < size; p++) {
                if (p == rank) continue;
                MPI_Irecv(rb + (long)p * n, (int)n, MPI_BYTE, p, 2, MPI_COMM_WORLD, &req[m++]);
            }
            for (int p = 0; p < size; p++) {
                if (p == rank) continue;
                fill(sb + (long)p * n, n, rank, p, k, 2);
                MPI_Isend(sb + (long)p * n, (int)n, MPI_BYTE, p, 2, MPI_COMM_WORLD, &req[m++]);
            }
            for (int done = 0; !done;) MPI_Testall(m, req, &done, MPI_STATUSES_IGNORE);
            for (int p = 0; p < size; p++) {
                if (p == rank) continue;
                errors += check(rb + (long)p * n, n, p, rank, k, 2);
                checked += n;
            }
            /* 3: Alltoall (at most 64 KiB per pair: it is the collective that is checked). */
            long a = n < 65536 ? n : 65536;
            for (int p = 0; p < size; p++) fill(sb + (long)p * a, a, rank, p, k, 3);
            MPI_Alltoall(sb, (int)a, MPI_BYTE, rb, (int)a, MPI_BYTE, MPI_COMM_WORLD);
            for (int p = 0; p < size; p++) {
                errors += check(rb + (long)p * a, a, p, rank, k, 3);
                checked += a;
            }
        }
        k++;
        /* Everyone agrees on whether to go on (rank 0's clock decides). */
        go = MPI_Wtime() - t0 < seconds;
        MPI_Bcast(&go, 1, MPI_INT, 0, MPI_COMM_WORLD);
    }
    long total = 0;
    MPI_Allreduce(&errors, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    printf("{\"rank\": %d, \"size\": %d, \"pid\": %d, \"rounds\": %ld, \"checked_bytes\": %ld, "
           "\"errors\": %ld}\n", rank, size, (int)getpid(), k, checked, total);
    fflush(stdout);
    free(sb);
    free(rb);
    free(req);
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
