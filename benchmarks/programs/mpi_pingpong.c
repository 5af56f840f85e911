/* An MPI ping-pong between ranks 0 and 1, for any MPI (bench.py builds it with MPICH's
 * mpicc): one-way time of an 8-byte message and bandwidth of a 1 MiB one, NetPIPE's way
 * (size over the one-way time of a ping-pong).
 *
 *     mpi_pingpong [WARMUP_SECONDS [MEASURE_SECONDS]]
 *
 * Each size first runs for WARMUP_SECONDS (default 2: the time a layer may take to settle its
 * connections, on one node moving them onto shared memory), then for MEASURE_SECONDS
 * (default 2); rank 0 decides when a phase ends and tells rank 1 in the message itself. Rank 0
 * prints one JSON line: {"lat8_us": T, "bw1m_mbps": B, "iters8": N, "iters1m": M}; every
 * message's first and last bytes are checked ("bad" counts the wrong ones). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Ping-pongs `size`-byte messages for `seconds`; returns the one-way time in seconds and
 * counts the iterations. The first byte of rank 0's message is 1 while the phase goes on. */
static double phase(int rank, char *buf, int size, double seconds, long *iters, long *bad) {
    long n = 0;
    double t0 = MPI_Wtime(), t = t0;
    for (;;) {
        if (rank == 0) {
            int go = t - t0 < seconds;
            buf[0] = (char)go;
            buf[size - 1] = (char)(n & 0x7f);
            MPI_Send(buf, size, MPI_CHAR, 1, 0, MPI_COMM_WORLD);
            MPI_Recv(buf, size, MPI_CHAR, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (buf[0] != (char)go || buf[size - 1] != (char)(n & 0x7f))
                (*bad)++;
            if (!go)
                break;
            n++;
            if ((n & 63) == 0 || size > 4096)
                t = MPI_Wtime();
        } else {
            MPI_Recv(buf, size, MPI_CHAR, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(buf, size, MPI_CHAR, 0, 0, MPI_COMM_WORLD);
            if (!buf[0])
                break;
            n++;
        }
    }
    double t1 = MPI_Wtime();
    *iters = n;
    return n > 0 ? (t1 - t0) / n / 2 : 0;
}

int main(int argc, char **argv) {
    int rank;
    double warm = argc > 1 ? atof(argv[1]) : 2.0, meas = argc > 2 ? atof(argv[2]) : 2.0;
    const int big = 1 << 20;
    char *buf = calloc(1, big);
    long it8 = 0, it1m = 0, bad = 0, skip = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (!buf)
        MPI_Abort(MPI_COMM_WORLD, 1);
    memset(buf, 0x5a, big);
    phase(rank, buf, 8, warm, &skip, &bad);
    double lat = phase(rank, buf, 8, meas, &it8, &bad);
    phase(rank, buf, big, warm / 4, &skip, &bad);
    double t1m = phase(rank, buf, big, meas, &it1m, &bad);
    if (rank == 0)
        printf("{\"lat8_us\": %.4f, \"bw1m_mbps\": %.1f, \"iters8\": %ld, \"iters1m\": %ld, \"bad\": %ld}\n",
               lat * 1e6, t1m > 0 ? big * 8.0 / t1m / 1e6 : 0.0, it8, it1m, bad);
    MPI_Finalize();
    free(buf);
    return bad != 0;
}
