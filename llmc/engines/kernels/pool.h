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
 * runs its tasks in its own thread. After its share of a call, a worker runs the idle function if one is set
 * (llmc_pool_when_idle: ahead.h reads the next product's weights ahead there) until the next call comes.
 */
#ifndef LLMC_POOL_H
#define LLMC_POOL_H

#include <stddef.h>
#include <stdint.h>

/* Runs fn(data, i) for i in [0, total) over the pool of `threads` threads (the caller one of them); the
 * llmc_parallel_fn form, ctx pointing at the thread count (an int). */
void llmc_pool_run(void* threads, void (*fn)(void*, size_t), size_t total, void* data);

/* The index of the thread that calls it in the pool: 0 for a caller while it runs its call's tasks, 1 .. threads - 1
 * for the workers, -1 for any other thread (one of ONNX Runtime's, or a caller running its tasks alone). A task may
 * use it to pick the share of a call this thread is best placed to run (ahead.h), never for correctness. */
int llmc_pool_self(void);

/* Sets the function each worker runs after its share of every call (NULL: none), with the call's generation: idle
 * time until the next call. It must return soon after llmc_pool_idle_since(call) turns 0, which the next call's
 * tasks then wait for. */
void llmc_pool_when_idle(void (*fn)(uint32_t call));
/* 1 while no call after `call` has been published. */
int llmc_pool_idle_since(uint32_t call);

/* The workers started so far (tests). */
int llmc_pool_workers(void);

#endif
