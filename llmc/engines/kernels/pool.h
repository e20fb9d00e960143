/* llmc's own thread pool for its operators, in place of ONNX Runtime's intra-op pool where every heavy node of a
 * graph is llmc's (pool.c; the session then runs ONNX Runtime's own nodes on one thread).
 *
 * Why: a decode step is ~210 short parallel calls (SmolLM2: 121 products of 0.2-1.1 MB of weights, 30 attention
 * nodes, 60 norms). Handed to ONNX Runtime's ParallelFor (a parallel section of its Eigen pool: work items pushed
 * to the workers' queues, the section closed when they are revoked or done), each call cost ~3 us more than a spin
 * pool that publishes the call in one cache line: a 207 KB product took 11.8-15.1 us on two threads against
 * 7.6-9.5 us (docs/performance_notes.md).
 *
 * The pool: threads - 1 workers, started on first use, each spinning on the call counter for 50 us after its last
 * task, then yielding its core between checks up to LLMC_POOL_SPIN_US (default 2,000: the gap between two decode
 * steps), then sleeping on a futex; the caller runs tasks too. Tasks are claimed
 * from one counter, so a late worker leaves its share to the caller (run_part's parts take the others' units from
 * their ends either way). One call at a time: a second caller meanwhile (another session's thread, a nested call)
 * runs its tasks in its own thread.
 */
#ifndef LLMC_POOL_H
#define LLMC_POOL_H

#include <stddef.h>

/* Runs fn(data, i) for i in [0, total) over the pool of `threads` threads (the caller one of them); the
 * llmc_parallel_fn form, ctx pointing at the thread count (an int). */
void llmc_pool_run(void* threads, void (*fn)(void*, size_t), size_t total, void* data);

/* The workers started so far (tests). */
int llmc_pool_workers(void);

#endif
