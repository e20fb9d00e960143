/* Reading ahead of the next decode product's weights (ahead.h). */
#include "ahead.h"

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define AHEAD_X86 1
#include <immintrin.h>
#endif
#include <stdlib.h>

#define NODES 4096       /* products remembered (SmolLM2: 121 a graph): a full table only stops the learning */
#define PROBES 32        /* slots a product's weights may take from their hash on */
#define STEP_BYTES 2048  /* prefetched between two looks for the next call: a worker joins it <~0.2 us late */
#define DEFAULT_KB 2048  /* measured 256-8,192 within a few % of each other on the EPYC VM (1 MB L2 a core, 32 MB L3) */

typedef struct node {
  const void* w; /* the key: the packed weights' address */
  int64_t unit_bytes, units, parts;
  struct node* next; /* the product that ran after this one last time */
} node;

static node table[NODES];
static node* last;     /* the product that ran last */
static node* target;   /* the successor of the product in flight: where the idle workers read */
static uint32_t epoch; /* +1 a product: a worker seeing it change starts over at the new target */
static int64_t budget = -1; /* bytes a worker reads ahead of a product (0: off); -1 until read from the environment */
static int64_t prefetched;

#ifdef AHEAD_X86
static void read_ahead(uint32_t call);
#define READER read_ahead
#else
#define READER NULL /* (reading ahead is off: the prefetch is x86's) */
#endif

static int64_t budget_bytes(void) {
  int64_t b = __atomic_load_n(&budget, __ATOMIC_ACQUIRE);
  if (b >= 0) return b;
#ifdef AHEAD_X86
  const char* e = getenv("LLMC_AHEAD_KB");
  long kb = e && *e ? atol(e) : DEFAULT_KB;
  b = kb > 0 ? (int64_t)kb * 1024 : 0;
#else
  b = 0; /* (the prefetch is x86's) */
#endif
  if (b) llmc_pool_when_idle(READER);
  __atomic_store_n(&budget, b, __ATOMIC_RELEASE);
  return b;
}

/* The table's node for weights w (claim: taken for them if new), NULL when there is none. */
static node* node_of(const void* w, int claim) {
  uintptr_t h = (uintptr_t)w >> 6;
  h = (uintptr_t)((uint64_t)h * 0x9E3779B97F4A7C15ull >> 40);
  for (int i = 0; i < PROBES; i++) {
    node* n = &table[(h + (uintptr_t)i) % NODES];
    const void* k = __atomic_load_n(&n->w, __ATOMIC_ACQUIRE);
    if (k == w) return n;
    if (!k && !claim) return NULL;
    if (!k && __atomic_compare_exchange_n(&n->w, &k, w, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return n;
    if (k == w) return n; /* (claimed by another caller meanwhile) */
  }
  return NULL;
}

void llmc_ahead_before(const void* w, int64_t unit_bytes, int64_t units, int64_t parts) {
  if (!budget_bytes() || !w || parts < 1) return;
  node* n = node_of(w, 1);
  if (!n) return;
  /* (each store only where the value changes: the lines the workers read stay clean in their caches) */
  if (__atomic_load_n(&n->unit_bytes, __ATOMIC_RELAXED) != unit_bytes)
    __atomic_store_n(&n->unit_bytes, unit_bytes, __ATOMIC_RELAXED);
  if (__atomic_load_n(&n->units, __ATOMIC_RELAXED) != units) __atomic_store_n(&n->units, units, __ATOMIC_RELAXED);
  if (__atomic_load_n(&n->parts, __ATOMIC_RELAXED) != parts) __atomic_store_n(&n->parts, parts, __ATOMIC_RELEASE);
  node* before = __atomic_load_n(&last, __ATOMIC_RELAXED);
  if (before != n) __atomic_store_n(&last, n, __ATOMIC_RELAXED);
  if (before && before != n && __atomic_load_n(&before->next, __ATOMIC_RELAXED) != n)
    __atomic_store_n(&before->next, n, __ATOMIC_RELEASE);
  __atomic_store_n(&target, __atomic_load_n(&n->next, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  __atomic_add_fetch(&epoch, 1, __ATOMIC_RELEASE);
}

/* A worker's place in the chain (thread-local: read once and written back once a call, as each access to a shared
 * library's thread-locals is a call of __tls_get_addr). */
typedef struct {
  node *at, *start; /* the product being read and the one the chain began at (NULL: done) */
  int64_t off, spent; /* bytes read of `at`'s part, and of the budget */
  uint32_t seen;      /* the epoch `start` was taken at */
} cursor;

/* A worker's idle time after call `call`: its part of the target's weights, then of the products after it, until
 * the budget is read or the next call comes. Where it got to is kept across calls (the attention's and the
 * norms' calls come between two products) until the next product moves the target. */
#ifdef AHEAD_X86
static void read_ahead(uint32_t call) {
  static _Thread_local cursor mine;
  cursor* where = &mine;
  cursor c = *where;
  uint32_t e = __atomic_load_n(&epoch, __ATOMIC_ACQUIRE);
  if (e != c.seen) {
    c.seen = e;
    c.at = c.start = __atomic_load_n(&target, __ATOMIC_ACQUIRE);
    c.off = c.spent = 0;
  }
  int self = llmc_pool_self();
  int64_t limit = __atomic_load_n(&budget, __ATOMIC_RELAXED), done = 0;
  while (c.at && c.spent < limit && llmc_pool_idle_since(call)) {
    int64_t parts = __atomic_load_n(&c.at->parts, __ATOMIC_ACQUIRE);
    int64_t units = __atomic_load_n(&c.at->units, __ATOMIC_RELAXED);
    int64_t unit_bytes = __atomic_load_n(&c.at->unit_bytes, __ATOMIC_RELAXED);
    if (parts < 1 || units < parts || unit_bytes < 1) {
      c.at = NULL;
      break;
    }
    int64_t p = self % parts, first = units * p / parts;
    int64_t len = (units * (p + 1) / parts - first) * unit_bytes;
    const char* base = (const char*)c.at->w + first * unit_bytes;
    int64_t from = c.off, stop = c.off + STEP_BYTES < len ? c.off + STEP_BYTES : len;
    for (; c.off < stop; c.off += 64) _mm_prefetch(base + c.off, _MM_HINT_T2);
    c.spent += STEP_BYTES; /* (a whole step even at a part's end: the budget bounds the loop) */
    done += c.off - from;
    if (c.off >= len) { /* on to the product after it, unless the chain came round (all of a small model's) */
      c.at = __atomic_load_n(&c.at->next, __ATOMIC_ACQUIRE);
      c.at = c.at == c.start ? NULL : c.at;
      c.off = 0;
    }
  }
  *where = c;
  if (done) __atomic_add_fetch(&prefetched, done, __ATOMIC_RELAXED);
}
#endif

int64_t llmc_ahead_own_part(size_t task, int64_t parts) {
  int self = llmc_pool_self();
  return self >= 0 ? self % parts : (int64_t)(task % (size_t)parts);
}

void llmc_ahead_set_kb(int64_t kb) {
#ifdef AHEAD_X86
  int64_t b = kb > 0 ? kb * 1024 : 0;
#else
  int64_t b = 0;
  (void)kb;
#endif
  llmc_pool_when_idle(b ? READER : NULL);
  __atomic_store_n(&budget, b, __ATOMIC_RELEASE);
}

int64_t llmc_ahead_kb(void) { return budget_bytes() / 1024; }

int64_t llmc_ahead_bytes(void) { return __atomic_load_n(&prefetched, __ATOMIC_RELAXED); }

const void* llmc_ahead_successor(const void* w) {
  node* n = node_of(w, 0);
  node* next = n ? __atomic_load_n(&n->next, __ATOMIC_ACQUIRE) : NULL;
  return next ? next->w : NULL;
}
