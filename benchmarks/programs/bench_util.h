/*
 * Helpers shared by the one-process benchmark programs (nontcp_calls.c, vc_calls.c).
 */
#ifndef VMI_BENCH_UTIL_H
#define VMI_BENCH_UTIL_H

#include <stdio.h>
#include <string.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds. */
static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Whether libvmi_preload is mapped into this process (from /proc/self/maps), so a caller
 * can check that a layered run really had the layer. */
static int preloaded(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (f == NULL)
        return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL)
        found = strstr(line, "libvmi_preload") != NULL;
    fclose(f);
    return found;
}

#endif
