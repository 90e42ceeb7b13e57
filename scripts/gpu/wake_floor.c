// The floor under capture's 100 Hz sampling: CPU of a native thread that only wakes at a fixed
// rate (MODE 0), and that also reads NVML's v1 memory struct on each wake (MODE 1), with no
// Python at all. Built and run by scripts/gpu/wake_floor.sh; prints one JSON object.
// usage: wake_floor HZ SECONDS MODE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
typedef struct { unsigned long long total, free, used; } mem_v1;
int main(int argc, char **argv) {
    int hz = atoi(argv[1]); double seconds = atof(argv[2]); int mode = atoi(argv[3]);
    void *handle = 0; mem_v1 mem; int (*get_mem)(void *, mem_v1 *) = 0;
    if (mode) {
        void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        if (!lib) { fprintf(stderr, "no libnvidia-ml: %s\n", dlerror()); return 2; }
        int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
        int (*by_index)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
        get_mem = (int (*)(void *, mem_v1 *))dlsym(lib, "nvmlDeviceGetMemoryInfo");
        if (init() || by_index(0, &handle)) { fprintf(stderr, "nvml init failed\n"); return 2; }
        get_mem(handle, &mem);
    }
    long period = 1000000000L / hz; long ticks = (long)(seconds * hz);
    struct timespec next, w0, w1; clock_gettime(CLOCK_MONOTONIC, &next); w0 = next;
    struct rusage r0, r1; getrusage(RUSAGE_SELF, &r0);
    unsigned long long acc = 0;
    for (long i = 0; i < ticks; i++) {
        next.tv_nsec += period; if (next.tv_nsec >= 1000000000L) { next.tv_nsec -= 1000000000L; next.tv_sec++; }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, 0);
        if (mode) { get_mem(handle, &mem); acc += mem.used; }
    }
    clock_gettime(CLOCK_MONOTONIC, &w1); getrusage(RUSAGE_SELF, &r1);
    double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec)
        + ((r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) + (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec)) / 1e6;
    double wall = (w1.tv_sec - w0.tv_sec) + (w1.tv_nsec - w0.tv_nsec) / 1e9;
    printf("{\"hz\": %d, \"mode\": %d, \"wall_s\": %.3f, \"cpu_s\": %.4f, \"cpu_pct\": %.3f, \"us_per_tick\": %.1f, \"check\": %llu}\n",
           hz, mode, wall, cpu, 100 * cpu / wall, 1e6 * cpu / ticks, acc % 7);
    return 0;
}
