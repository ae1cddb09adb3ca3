/* A memory cap for a device served by `ebb-engine rpc-serve --device-memory`.
 *
 * Loaded with LD_PRELOAD into the RPC server only. ggml's RPC server allocates every buffer a
 * client asks for through ggml_backend_buft_alloc_buffer and frees it through
 * ggml_backend_buffer_free, both exported by libggml-base and called from libggml-rpc, so a
 * preloaded definition takes their place. An allocation that would pass the cap fails the way a
 * full GPU's does: the call returns NULL, the server answers the client with a null buffer, and
 * llama.cpp on the client reports that it could not allocate. The device's reported memory
 * (ggml_backend_dev_memory) becomes the cap and what is left of it.
 *
 * The cap is read from EBB_DEVICE_MEMORY (bytes) at the first call; 0 or unset: no cap.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

typedef void *buft_t;
typedef void *buffer_t;
typedef void *dev_t_;

#define MAX_BUFFERS 65536

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t cap, used, peak;
static unsigned long n_refused;
static int ready;
static buffer_t tracked[MAX_BUFFERS];
static size_t tracked_size[MAX_BUFFERS];

static buffer_t (*real_alloc)(buft_t, size_t);
static void (*real_free)(buffer_t);
static size_t (*real_get_size)(buffer_t);
static void (*real_memory)(dev_t_, size_t *, size_t *);

static void *find(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (f == NULL) {
        void *h = dlopen("libggml-base.so.0", RTLD_NOW | RTLD_NOLOAD);
        if (h != NULL) f = dlsym(h, name);
    }
    if (f == NULL) {
        fprintf(stderr, "ebb devcap: %s not found: is libggml-base loaded?\n", name);
        abort();
    }
    return f;
}

static void init(void) {
    if (ready) return;
    real_alloc = find("ggml_backend_buft_alloc_buffer");
    real_free = find("ggml_backend_buffer_free");
    real_get_size = find("ggml_backend_buffer_get_size");
    real_memory = find("ggml_backend_dev_memory");
    const char *s = getenv("EBB_DEVICE_MEMORY");
    cap = s ? (size_t)strtoull(s, NULL, 10) : 0;
    ready = 1;
}

buffer_t ggml_backend_buft_alloc_buffer(buft_t buft, size_t size) {
    pthread_mutex_lock(&lock);
    init();
    if (cap && (size > cap || used + size > cap)) {
        n_refused++;
        pthread_mutex_unlock(&lock);
        fprintf(stderr, "ebb devcap: refused %zu bytes (%zu of %zu in use)\n", size, used, cap);
        return NULL;
    }
    buffer_t b = real_alloc(buft, size);
    if (b != NULL) {
        size_t n = real_get_size(b);
        for (int i = 0; i < MAX_BUFFERS; i++) {
            if (tracked[i] == NULL) {
                tracked[i] = b;
                tracked_size[i] = n;
                used += n;
                if (used > peak) peak = used;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return b;
}

void ggml_backend_buffer_free(buffer_t b) {
    pthread_mutex_lock(&lock);
    init();
    if (b != NULL) {
        for (int i = 0; i < MAX_BUFFERS; i++) {
            if (tracked[i] == b) {
                used -= tracked_size[i];
                tracked[i] = NULL;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    real_free(b);
}

void ggml_backend_dev_memory(dev_t_ dev, size_t *free_b, size_t *total_b) {
    pthread_mutex_lock(&lock);
    init();
    size_t c = cap, u = used;
    pthread_mutex_unlock(&lock);
    real_memory(dev, free_b, total_b);
    if (c) {
        *total_b = c;
        *free_b = u < c ? c - u : 0;
    }
}

/* for the server's own report and for tests: bytes in use, the most ever, the cap, refusals */
void ebb_devcap_stats(size_t *out_used, size_t *out_peak, size_t *out_cap, unsigned long *out_refused) {
    pthread_mutex_lock(&lock);
    init();
    *out_used = used;
    *out_peak = peak;
    *out_cap = cap;
    *out_refused = n_refused;
    pthread_mutex_unlock(&lock);
}
