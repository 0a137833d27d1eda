/* The demo workload: a toy request server on jemalloc. Each "request" reads
 * into a buffer that is freed at once, some responses are cached for good
 * (the cache grows like a leak), and a session table is rebuilt every so
 * often (a stable working set). It prints "ready <pid>" and runs until killed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SESSIONS 256

static void **cache;
static size_t cache_len, cache_cap;
static void *sessions[SESSIONS];

__attribute__((noinline)) void *read_request(size_t size) {
    char *buffer = malloc(size);
    memset(buffer, 'r', size < 64 ? size : 64);
    return buffer;
}

__attribute__((noinline)) void cache_response(size_t size) {
    if (cache_len == cache_cap) {
        cache_cap = cache_cap ? cache_cap * 2 : 1024;
        cache = realloc(cache, cache_cap * sizeof *cache);
    }
    cache[cache_len] = malloc(size);
    memset(cache[cache_len], 'c', 64);
    cache_len++;
}

__attribute__((noinline)) void rebuild_session(int slot) {
    free(sessions[slot]);
    sessions[slot] = calloc(1, 64 * 1024);
}

__attribute__((noinline)) void serve(unsigned long request) {
    void *buffer = read_request(2048 + (request % 7) * 512);
    if (request % 16 == 0) {
        cache_response(8192);
    }
    if (request % 8 == 0) {
        rebuild_session((int)(request / 8 % SESSIONS));
    }
    free(buffer);
}

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready %d\n", (int)getpid());
    struct timespec pause = {0, 200 * 1000};
    for (unsigned long request = 0;; request++) {
        serve(request);
        if (request % 64 == 0) {
            nanosleep(&pause, NULL);
        }
    }
}
