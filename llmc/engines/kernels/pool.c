/* llmc's own thread pool (pool.h). */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 255
#define HOT_NS 50000L /* a worker spins this long after its last task before it yields its core between checks */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* A call's task function, its argument and its task count. */
typedef struct {
  void (*fn)(void*, size_t);
  void* data;
  size_t total;
} call_t;

/* The call in flight: its generation and next task in one word, so a worker's claim fails once the call it saw
 * is over (a call ends only when every task is claimed and done). Each call's fn, data and total go to the slot
 * of its generation's parity, written before the generation is published: a worker that read generation g reads
 * g's slot, and its claim of a task of g succeeds only while g is the call in flight, when that slot is still g's
 * (the next call writes the other slot; the one after it cannot start before g's tasks are done). With one set of
 * fields, a worker that had read the word of a finished call (g, its total) and then the next call's larger total
 * could claim index total_g under generation g before the next generation was published, run the next call's
 * function with it, and count it done: that task ran twice and `done` passed `total`, so the caller spun forever
 * (seen once on the EPYC VM, in a `llmc bench` at batch 1: the caller in the wait below, the worker asleep). */
static struct {
  _Alignas(64) uint64_t word; /* generation << 32 | next task */
  _Alignas(64) size_t done;   /* tasks of the call done */
  _Alignas(64) uint32_t wake; /* the futex the sleeping workers wait on: +1 a call */
  int sleepers;
  _Alignas(64) call_t call[2]; /* [generation & 1] */
  int busy;    /* a call in flight: a second caller runs its own tasks */
  int workers; /* started */
  long spin_ns;
  pthread_mutex_t start;
} P = {.start = PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claims and runs call g's tasks until none is left (or the call is over). */
static void work(uint32_t g) {
  for (;;) {
    uint64_t w = __atomic_load_n(&P.word, __ATOMIC_SEQ_CST);
    if ((uint32_t)(w >> 32) != g) return;
    size_t i = (uint32_t)w;
    call_t* c = &P.call[g & 1]; /* call g's where the claim below holds */
    void (*fn)(void*, size_t) = __atomic_load_n(&c->fn, __ATOMIC_RELAXED);
    void* data = __atomic_load_n(&c->data, __ATOMIC_RELAXED);
    if (i >= __atomic_load_n(&c->total, __ATOMIC_RELAXED)) return;
    if (!__atomic_compare_exchange_n(&P.word, &w, w + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) continue;
    fn(data, i);
    __atomic_add_fetch(&P.done, 1, __ATOMIC_SEQ_CST);
  }
}

/* This thread's index in the pool (pool.h): 0 while it runs a call as its caller, w for worker w, else -1. Stored
 * plus one, so that every other thread's zero means -1. */
static _Thread_local int self_plus_one;
int llmc_pool_self(void) { return self_plus_one - 1; }

static void (*idle_fn)(uint32_t);
void llmc_pool_when_idle(void (*fn)(uint32_t)) { __atomic_store_n(&idle_fn, fn, __ATOMIC_RELEASE); }
int llmc_pool_idle_since(uint32_t call) {
  return (uint32_t)(__atomic_load_n(&P.word, __ATOMIC_RELAXED) >> 32) == call;
}

static void* worker(void* arg) {
  self_plus_one = (int)(intptr_t)arg + 1;
  uint32_t seen = (uint32_t)(__atomic_load_n(&P.word, __ATOMIC_SEQ_CST) >> 32);
  for (;;) {
    long since = now_ns();
    uint32_t g;
    for (unsigned spins = 1; (g = (uint32_t)(__atomic_load_n(&P.word, __ATOMIC_SEQ_CST) >> 32)) == seen; spins++) {
      relax();
      if (spins % 64) continue;
      long waited = now_ns() - since;
      if (waited < HOT_NS) continue;
      if (waited < P.spin_ns) { /* between decode steps: awake, but the core is the others' to take */
        sched_yield();
        continue;
      }
      uint32_t wake = __atomic_load_n(&P.wake, __ATOMIC_SEQ_CST);
      __atomic_add_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
      if ((uint32_t)(__atomic_load_n(&P.word, __ATOMIC_SEQ_CST) >> 32) == seen)
        syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, wake, NULL, NULL, 0);
      __atomic_sub_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
      since = now_ns();
    }
    seen = g;
    work(g);
    void (*fn)(uint32_t) = __atomic_load_n(&idle_fn, __ATOMIC_ACQUIRE);
    if (fn) fn(g);
  }
  return NULL;
}

/* A child of fork() has none of the parent's workers. */
static void forked(void) {
  P.workers = 0;
  P.busy = 0;
  P.sleepers = 0;
  pthread_mutex_init(&P.start, NULL);
}

static void start_workers(int n) {
  if (n > MAX_WORKERS) n = MAX_WORKERS;
  if (__atomic_load_n(&P.workers, __ATOMIC_ACQUIRE) >= n) return;
  pthread_mutex_lock(&P.start);
  if (!P.workers) {
    const char* e = getenv("LLMC_POOL_SPIN_US");
    long us = e && *e ? atol(e) : 2000;
    P.spin_ns = (us < 0 ? 0 : us) * 1000L;
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, forked);
  }
  while (P.workers < n) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&t, &attr, worker, (void*)(intptr_t)(P.workers + 1));
    pthread_attr_destroy(&attr);
    if (failed) break; /* the caller and the workers there are take the tasks */
    __atomic_add_fetch(&P.workers, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&P.start);
}

void llmc_pool_run(void* threads_, void (*fn)(void*, size_t), size_t total, void* data) {
  int threads = threads_ ? *(const int*)threads_ : 1;
  if (total > 1 && threads > 1 && total <= UINT32_MAX && !__atomic_exchange_n(&P.busy, 1, __ATOMIC_SEQ_CST)) {
    start_workers(threads - 1);
    uint32_t g = (uint32_t)(__atomic_load_n(&P.word, __ATOMIC_SEQ_CST) >> 32) + 1;
    call_t* c = &P.call[g & 1]; /* (published by the generation's store below) */
    __atomic_store_n(&c->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&c->data, data, __ATOMIC_RELAXED);
    __atomic_store_n(&c->total, total, __ATOMIC_RELAXED);
    __atomic_store_n(&P.done, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&P.word, (uint64_t)g << 32, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&P.wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&P.sleepers, __ATOMIC_SEQ_CST))
      syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    int kept = self_plus_one;
    self_plus_one = 1;
    work(g);
    self_plus_one = kept;
    while (__atomic_load_n(&P.done, __ATOMIC_SEQ_CST) != total) relax();
    __atomic_store_n(&P.busy, 0, __ATOMIC_SEQ_CST);
    return;
  }
  for (size_t i = 0; i < total; i++) fn(data, i);
}

int llmc_pool_workers(void) { return __atomic_load_n(&P.workers, __ATOMIC_ACQUIRE); }
