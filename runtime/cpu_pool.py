"""A native pool of CPU worker threads that runs tinygrad's CPU kernels on every core.

tinygrad 0.14 renders a CPU kernel split in N parts by a `core_id` argument (NUM_CPU_THREADS), then calls the parts one after
another on one thread. This pool runs the parts side by side: the calling thread and N-1 pthreads each take parts
t, t+N, t+2N, ... of a kernel, then meet at a barrier before the next kernel. A whole list of kernels (a TinyJit capture)
goes to C in one call, so a decode step of hundreds of kernels costs one ctypes call and one barrier per split kernel
(about a microsecond between cores of one socket), not a Python round trip per kernel. Kernels that were not split run on
the caller alone while the workers wait.

A kernel of k parts runs on min(k, N) threads: the caller and workers 1..k-1, each woken through a word of its own (one cache
line per worker), so a small kernel does not wake, and wait on, every worker of a big node. Workers spin briefly between
kernels (the next split kernel usually comes within microseconds), then sleep on their futex, so an idle pool costs no
CPU; the caller, waiting for the parts of a kernel, yields its CPU after a short spin, so a worker descheduled by another
process gets to finish. Worker i is pinned to the i-th CPU (mod their count) of the process's affinity mask when the pool
starts (the caller, thread 0, is left where it is). The pool is process-wide; a thread that finds it busy (another thread
is running kernels on it) runs its kernel's parts itself, one after another, instead of waiting.

The C source is compiled once with the same compiler tinygrad uses (clang) and cached under ~/.cache/tinyhet.
"""
from __future__ import annotations
import ctypes, hashlib, os, subprocess, tempfile, threading
from pathlib import Path

MAX_ARGS = 63   # tinygrad's CPU programs take at most 63 arguments (ops_cpu.MAX_ARGS)

class Command(ctypes.Structure):
  """One kernel launch: fn(args[0..nargs)), run as `parts` parts with args[core_slot] = part id (core_slot < 0: one part)."""
  _fields_ = [("fn", ctypes.c_uint64), ("nargs", ctypes.c_int32), ("core_slot", ctypes.c_int32), ("parts", ctypes.c_int32),
              ("_pad", ctypes.c_int32), ("args", ctypes.c_uint64 * MAX_ARGS)]

_ARGS = ", ".join(f"a[{i}]" for i in range(MAX_ARGS))
_TYPES = ", ".join(["u64"] * MAX_ARGS)

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdatomic.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sched.h>
typedef uint64_t u64;
typedef struct { u64 fn; int32_t nargs, core_slot, parts, pad; u64 args[%(max_args)d]; } cmd_t;
typedef void (*k63)(%(types)s);

static struct {
  int n;                                  /* threads, the caller included */
  int active;                             /* threads the current kernel runs on: min(its parts, n) */
  _Atomic int done, quit;
  const cmd_t *cur;
  pthread_mutex_t busy;
  pthread_t tid[1024];
  long spin;
} P = {.busy = PTHREAD_MUTEX_INITIALIZER};

/* One cache line per worker: its own generation word (bumped when a kernel has a part for it) and sleep flag, so a kernel
   of k parts wakes k - 1 workers, not all of them; wakes counts the kernels a worker took (tests read it). */
typedef struct { _Atomic uint32_t gen; _Atomic int sleeping; _Atomic long wakes; char pad[48]; } slot_t;
static slot_t W[1024];
static int cpus[1024], ncpus;             /* the affinity mask's CPUs: worker i is pinned to cpus[i %% ncpus] */

/* Replicated read-only ranges (numa = replicate): range i is [rb[i], rb[i] + rl[i]), sorted, its copy k at rcopy[i][k]
   (copy 0: the range itself); a thread reads copy tcopy[thread]: each argument pointing into a range is moved to that copy. */
#define MAX_REPLICAS 8
static int R;
static u64 rb[8192], rl[8192], rcopy[8192][MAX_REPLICAS];
static int tcopy[1024];

static inline u64 remap(u64 a, int k) {
  int lo = 0, hi = R - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    if (a < rb[mid]) hi = mid - 1;
    else if (a >= rb[mid] + rl[mid]) lo = mid + 1;
    else return rcopy[mid][k] + (a - rb[mid]);
  }
  return a;
}

/* Every argument travels as a 64-bit integer, as tinygrad's ctypes call passes them. The x86-64 and AArch64 calling
   conventions let a caller pass more arguments than the callee reads, so one 63-argument call shape serves every kernel. */
static inline void run_part(const cmd_t *c, int part, int thread) {
  u64 a[%(max_args)d];
  for (int i = 0; i < c->nargs; i++) a[i] = c->args[i];
  if (R > 0 && tcopy[thread] > 0) for (int i = 0; i < c->nargs; i++) a[i] = remap(a[i], tcopy[thread]);
  for (int i = c->nargs; i < %(max_args)d; i++) a[i] = 0;
  if (c->core_slot >= 0) a[c->core_slot] = (u64)part;
  ((k63)c->fn)(%(args)s);
}

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* A worker starts at the generation current when it was created: one created after kernels ran must not take the last,
   finished command for a new one. */
static struct { int id; uint32_t gen; } start_args[1024];
static _Atomic int started;               /* workers that have named and pinned themselves */

static void pin(int id) {
  if (ncpus <= 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus[id %% ncpus], &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *worker(void *arg) {
  int id = ((typeof(start_args[0]) *)arg)->id;
  uint32_t seen = ((typeof(start_args[0]) *)arg)->gen;
  char name[16];
  snprintf(name, sizeof name, "tinyhet-cpu-%%d", id);
  pthread_setname_np(pthread_self(), name);
  pin(id);
  atomic_fetch_add(&started, 1);           /* named and pinned: pool_start returns once every worker is */
  slot_t *me = &W[id];
  for (;;) {
    uint32_t g;
    long spins = 0;
    while ((g = atomic_load_explicit(&me->gen, memory_order_acquire)) == seen) {
      if (++spins < P.spin) { relax(); continue; }
      atomic_store(&me->sleeping, 1);      /* seq_cst: pairs with run_split's bump of gen, then its load of sleeping */
      syscall(SYS_futex, (uint32_t *)&me->gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      atomic_store(&me->sleeping, 0);
      spins = 0;
    }
    seen = g;
    if (atomic_load(&P.quit)) return NULL;
    atomic_fetch_add_explicit(&me->wakes, 1, memory_order_relaxed);
    const cmd_t *c = P.cur;
    for (int t = id; t < c->parts; t += P.active) run_part(c, t, id);
    atomic_fetch_add_explicit(&P.done, 1, memory_order_acq_rel);
  }
}

/* Starts threads until there are n in all (the caller counts as one); a pool only grows. Returns the count. cpu_list[0..k):
   the CPUs to pin worker i to (cpu_list[i %% k]; the caller, thread 0, is not pinned); k = 0: no pinning. */
int pool_start(int n, long spin, const int *cpu_list, int k) {
  if (n < 1 || n > 1024 || k < 0 || k > 1024) return -1;
  pthread_mutex_lock(&P.busy);              /* no kernel is running while the thread count changes */
  if (P.n < 1) P.n = 1;
  P.spin = spin;
  for (int i = 0; i < k; i++) cpus[i] = cpu_list[i];
  ncpus = k;
  for (; P.n < n; P.n++) {
    start_args[P.n].id = P.n;
    start_args[P.n].gen = atomic_load(&W[P.n].gen);   /* cannot move: bumped only under `busy`, which this holds */
    if (pthread_create(&P.tid[P.n], NULL, worker, &start_args[P.n]) != 0) break;
  }
  while (atomic_load(&started) < P.n - 1) sched_yield();   /* a caller may look at the workers' names and CPUs at once */
  pthread_mutex_unlock(&P.busy);
  return P.n;
}

static void run_split(const cmd_t *c) {
  int active = c->parts < P.n ? c->parts : P.n;
  P.cur = c;
  P.active = active;
  atomic_store_explicit(&P.done, 0, memory_order_relaxed);
  for (int i = 1; i < active; i++) {                            /* only the workers this kernel has parts for */
    atomic_fetch_add(&W[i].gen, 1);                             /* seq_cst: pairs with the worker's sleeping store */
    if (atomic_load(&W[i].sleeping)) syscall(SYS_futex, (uint32_t *)&W[i].gen, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
  }
  for (int t = 0; t < c->parts; t += active) run_part(c, t, 0);
  /* a worker that lost its CPU to another process finishes only when it runs again: yield rather than spin it out */
  for (long spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < active - 1; spins++) {
    if (spins < 4096) relax(); else sched_yield();
  }
}

/* Runs cmds[0..n) in order, each split kernel on every thread; returns 1 if it ran them serially (the pool was busy). */
int pool_run(const cmd_t *cmds, int n) {
  int serial = P.n <= 1 || pthread_mutex_trylock(&P.busy) != 0;
  for (int i = 0; i < n; i++) {
    const cmd_t *c = &cmds[i];
    if (serial || c->parts <= 1 || c->core_slot < 0) { for (int t = 0; t < (c->parts > 0 ? c->parts : 1); t++) run_part(c, t, 0); }
    else run_split(c);
  }
  if (!serial) pthread_mutex_unlock(&P.busy);
  return serial;
}

/* Sets the replicated ranges (n of them, sorted by base, not overlapping; copies[i * ncopies + k]) and the copy each thread
   reads (thread_copy[0..nthreads)); n = 0 clears them. Returns 0, or -1 for a bad table. */
int pool_replicas(int n, const u64 *base, const u64 *len, const u64 *copies, int ncopies, const int *thread_copy, int nthreads) {
  if (n < 0 || n > 8192 || ncopies < 1 || ncopies > MAX_REPLICAS || nthreads < 0 || nthreads > 1024) return -1;
  for (int i = 0; i < n; i++) if (len[i] == 0 || (i > 0 && base[i] < base[i - 1] + len[i - 1])) return -1;
  for (int t = 0; t < nthreads; t++) if (thread_copy[t] < 0 || thread_copy[t] >= ncopies) return -1;
  pthread_mutex_lock(&P.busy);              /* no kernel reads the table while it changes */
  for (int i = 0; i < n; i++) {
    rb[i] = base[i], rl[i] = len[i];
    for (int k = 0; k < ncopies; k++) rcopy[i][k] = copies[i * ncopies + k];
  }
  for (int t = 0; t < 1024; t++) tcopy[t] = t < nthreads ? thread_copy[t] : 0;
  R = n;
  pthread_mutex_unlock(&P.busy);
  return 0;
}

/* First touch of a range by the threads that will read it (the KV pools): part `part` of `parts` zeroes its share of the
   range, whole pages [base + n*part/parts, base + n*(part+1)/parts) rounded to page boundaries, so a page lands on the
   node of the thread that ran the part (the kernel's first-touch policy, where no mbind policy says otherwise), and
   writes the CPU it ran on to ((int *)cpu_out)[part]. Run as a split kernel: part t on pool thread t. */
void pool_touch_part(u64 base, u64 nbytes, u64 parts, u64 cpu_out, u64 part) {
  const u64 page = 4096, end = base + nbytes;
  u64 first = base / page, last = (end + page - 1) / page, n = last - first;
  u64 lo = (first + n * part / parts) * page, hi = (first + n * (part + 1) / parts) * page;
  if (lo < base) lo = base;
  if (hi > end) hi = end;
  if (hi > lo) memset((void *)lo, 0, hi - lo);
  ((int *)cpu_out)[part] = sched_getcpu();
}

int pool_threads(void) { return P.n; }
long pool_wakes(int id) { return id > 0 && id < P.n ? atomic_load(&W[id].wakes) : -1; }
""" % {"max_args": MAX_ARGS, "types": _TYPES, "args": _ARGS}

def _cache_dir() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tinyhet"

def _compile() -> ctypes.CDLL:
  digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
  lib = _cache_dir() / f"cpu_pool-{digest}.so"
  if not lib.exists():
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
      src, out = Path(tmp) / "cpu_pool.c", Path(tmp) / "cpu_pool.so"
      src.write_text(SOURCE)
      cc = os.environ.get("CC", "clang")
      try: subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(out), str(src)], check=True, capture_output=True, text=True)
      except FileNotFoundError: raise RuntimeError(f"the CPU worker pool is compiled with {cc}, which is not installed: install clang") from None
      except subprocess.CalledProcessError as e: raise RuntimeError(f"compiling the CPU worker pool failed: {e.stderr.strip()}") from None
      os.replace(out, lib)     # atomic: a concurrent process sees the whole library or none
  dll = ctypes.CDLL(str(lib))
  dll.pool_start.argtypes, dll.pool_start.restype = [ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
  dll.pool_wakes.argtypes, dll.pool_wakes.restype = [ctypes.c_int], ctypes.c_long
  dll.pool_run.argtypes, dll.pool_run.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
  dll.pool_threads.restype = ctypes.c_int
  dll.pool_replicas.restype = ctypes.c_int
  return dll

class CpuPool:
  """The process's worker pool: `threads` threads in all (the caller's included)."""
  def __init__(self, threads: int, spin: int = 4000, pin: bool = True):
    self.lib, self.spin, self.threads, self.pin = _compile(), spin, 0, pin
    self.grow(threads)

  def grow(self, threads: int) -> int:
    """Start threads until there are `threads` in all (fewer if the OS refuses one); a pool never shrinks."""
    if not 1 <= threads <= 1024: raise ValueError(f"a CPU pool has 1 to 1024 threads, not {threads}")
    if threads > self.threads:
      cpus = sorted(os.sched_getaffinity(0)) if self.pin and hasattr(os, "sched_getaffinity") else []
      arr = (ctypes.c_int * max(1, len(cpus)))(*cpus)
      self.threads = self.lib.pool_start(threads, self.spin, ctypes.addressof(arr), len(cpus))
    return self.threads

  def set_replicas(self, ranges: list[tuple[int, int, list[int]]], thread_copy: list[int]) -> None:
    """Read-only ranges with copies (numa = replicate): (address, length, [copy 0 = address, copy 1, ...]) each, and the
    copy each thread (0 = the caller, 1.. the workers) reads: an argument of a kernel part pointing into a range is moved
    to that thread's copy. The ranges must not be written while set; [] clears them."""
    ranges = sorted(ranges)
    k = max([len(c) for _, _, c in ranges] or [1])
    if any(len(c) != k or c[0] != b for b, _, c in ranges): raise ValueError("set_replicas: each range needs as many copies, itself first")
    u64 = ctypes.c_uint64
    arr = lambda t, xs: (t * max(1, len(xs)))(*xs)
    if self.lib.pool_replicas(len(ranges), arr(u64, [b for b, _, _ in ranges]), arr(u64, [n for _, n, _ in ranges]),
                              arr(u64, [a for _, _, c in ranges for a in c]), k, arr(ctypes.c_int, thread_copy), len(thread_copy)) != 0:
      raise ValueError(f"set_replicas: a bad table ({len(ranges)} ranges, {k} copies, threads reading {thread_copy})")

  def pinned_cpu(self, thread: int) -> int | None:
    """The CPU worker `thread` is pinned to (None for the caller, thread 0, or without pinning)."""
    cpus = sorted(os.sched_getaffinity(0)) if self.pin and hasattr(os, "sched_getaffinity") else []
    return cpus[thread % len(cpus)] if thread > 0 and cpus else None

  def touch(self, addr: int, nbytes: int, parts: int | None = None) -> list[int]:
    """Zero [addr, addr + nbytes) in `parts` shares of whole pages (default: one per thread), share t by pool thread t, so
    that each share's pages are first touched, and so placed (no mbind policy on the range: the node of the CPU that touched
    them), where thread t runs. Returns the CPU each share ran on (all the caller's where the pool was busy: serial)."""
    parts = self.threads if parts is None else parts
    if not 1 <= parts <= self.threads or addr <= 0 or nbytes <= 0: raise ValueError(f"touch: {parts} parts of {nbytes} bytes at {addr:#x}")
    cpus = (ctypes.c_int * parts)(*([-1] * parts))
    fn = ctypes.cast(self.lib.pool_touch_part, ctypes.c_void_p).value
    cmd = (Command * 1)(Command(fn, 5, 4, parts, 0, (ctypes.c_uint64 * MAX_ARGS)(addr, nbytes, parts, ctypes.addressof(cpus))))
    self.run(cmd)
    return list(cpus)

  def wakes(self, worker: int) -> int:
    """How many split kernels worker (1..threads-1) has taken part in: a kernel of k parts wakes workers 1..k-1 only."""
    return self.lib.pool_wakes(worker)

  def run(self, cmds: ctypes.Array, n: int | None = None) -> bool:
    """Run the first n Commands of cmds in order (all by default); True if the pool was busy and they ran serially."""
    return bool(self.lib.pool_run(ctypes.addressof(cmds), len(cmds) if n is None else n))

_pool: CpuPool | None = None
_pool_lock = threading.Lock()

def cpu_pool(threads: int) -> CpuPool:
  """The process-wide pool, with at least `threads` threads (started on first use, grown when more are asked)."""
  global _pool
  with _pool_lock:
    if _pool is None: _pool = CpuPool(threads)
    elif threads > _pool.threads: _pool.grow(threads)
    return _pool
