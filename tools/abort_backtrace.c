/* LD_PRELOAD'ed by tools/launch_stress.py into every launched worker: when the process aborts (SIGABRT,
 * e.g. std::terminate from a std::thread destroyed while joinable), print the aborting thread's native
 * frames and the names of all the process's threads to stderr, then die of the same signal as before.
 * Build: gcc -shared -fPIC -O1 -o abort_backtrace.so abort_backtrace.c  (the harness does it). */
#define _GNU_SOURCE
#include <dirent.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void say(const char *s) { ssize_t r = write(2, s, strlen(s)); (void)r; }

static void list_threads(void) {
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    char path[128], name[64], line[256];
    if (!d) return;
    say("=== threads at SIGABRT (tid: name) ===\n");
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        ssize_t n = read(fd, name, sizeof name - 1);
        close(fd);
        name[n > 0 ? n : 0] = 0;
        snprintf(line, sizeof line, "  %s: %s", e->d_name, name);
        say(line);
    }
    closedir(d);
}

static void on_abort(int sig) {
    void *frames[256];
    char line[96];
    int n = backtrace(frames, 256);
    snprintf(line, sizeof line, "\n=== native backtrace at SIGABRT (pid %d, tid %ld) ===\n", getpid(),
             (long)syscall(SYS_gettid));
    say(line);
    backtrace_symbols_fd(frames, n, 2);
    list_threads();
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[1];
    backtrace(warm, 1); /* load libgcc's unwinder now, not inside the handler */
    signal(SIGABRT, on_abort);
}
