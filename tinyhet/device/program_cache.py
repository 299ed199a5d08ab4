"""tinygrad's generated programs kept across processes, so that a fresh process (a `tinyhet run` with --keep-alive 0, a
restarted node) does not generate every kernel's code again.

tinygrad keeps two caches of a kernel: the compiled object on disk (its sqlite cache, CACHEDB, keyed by the C source), and
the program (the kernel's optimization, linearization and rendering: `tinygrad.codegen.to_program`, most of the Python work
of a new kernel) in a dict that dies with the process. So a fresh process found every object on disk (measured: no compile
in a second `tinyhet run`) but generated the code of every kernel of its captures again, in a pool of spawned worker
processes (each importing tinygrad first): ~70% of the capture time of a fresh run's first prefill (SmolLM2, 2,000 tokens,
measured with timers around tinygrad's phases on a shared 2-core VM).

install() replaces that dict (one object that tinygrad.codegen and tinygrad.engine.realize share by name) with DiskPrograms:
a miss in memory looks in the same sqlite file (table tinyhet_programs), a new program is written there. The key is
tinygrad's own (the kernel's AST hash, the renderer and its target, the codegen settings) plus what else changes the code
generated for that key: the source of tinygrad's codegen and renderers (an upgraded or edited tinygrad gets new entries)
and whether tinyhet's thread-split hook is installed (tinyhet.device.cpu_threads.more_parts). CACHELEVEL=0 turns it off
with tinygrad's own cache. What stays per process: tinygrad's scheduling of each capture (the graph rewrites from a
Tensor computation to its kernels' ASTs; their results hold this process's buffers) and TinyJit's capture itself.
"""
from __future__ import annotations
import functools, hashlib, pathlib, pickle, sqlite3

TABLE = "tinyhet_programs"

@functools.cache
def tinygrad_codegen_hash() -> str:
  """A hash of tinygrad's code generation (codegen/ and renderer/ sources): what turns an AST into a program."""
  import tinygrad
  root, h = pathlib.Path(tinygrad.__file__).parent, hashlib.sha256()
  for p in sorted([*(root / "codegen").rglob("*.py"), *(root / "renderer").rglob("*.py")]):
    h.update(str(p.relative_to(root)).encode())
    h.update(p.read_bytes())
  return h.hexdigest()[:16]

def hooks() -> str:
  """What tinyhet has put into tinygrad's codegen in this process (the thread-split hook's version, or none)."""
  from tinygrad.codegen.opt import heuristic
  return getattr(heuristic.hand_coded_optimizations, "tinyhet_hook", "none")

def disk_key(key: tuple) -> str:
  """tinygrad's to_program_key (ast.key, renderer class, target, codegen settings) as one string, with the codegen's hash
  and the hooks: the same string in every process for the same program."""
  ast_key, renderer, target, *config = key
  return hashlib.sha256(repr((ast_key.hex(), f"{renderer.__module__}.{renderer.__qualname__}", repr(target), repr(config),
                              tinygrad_codegen_hash(), hooks())).encode()).hexdigest()

class DiskPrograms(dict):
  """tinygrad's to_program_cache, backed by its sqlite cache: `in` and get() load a program another process generated,
  a program set here is written for the next process. Counters: loaded (found on disk), stored (written)."""
  loaded = 0
  stored = 0

  def _load(self, key):
    from tinygrad.helpers import diskcache_get
    # a row written by code that unpickles differently now, or another thread's connection: generate the program again
    try: prg = diskcache_get(TABLE, disk_key(key))
    except Exception: return None
    if prg is None: return None
    dict.__setitem__(self, key, prg)
    DiskPrograms.loaded += 1
    return prg

  def __contains__(self, key) -> bool: return dict.__contains__(self, key) or self._load(key) is not None

  def __getitem__(self, key):
    if dict.__contains__(self, key) or self._load(key) is not None: return dict.__getitem__(self, key)
    raise KeyError(key)

  def get(self, key, default=None):
    return self[key] if key in self else default

  def __setitem__(self, key, prg) -> None:
    dict.__setitem__(self, key, prg)
    from tinygrad.helpers import diskcache_put
    try:
      diskcache_put(TABLE, disk_key(key), pickle.dumps(prg), prepickled=True)
      DiskPrograms.stored += 1
    except (sqlite3.Error, pickle.PicklingError, TypeError, AttributeError): pass   # kept in memory only

@functools.cache
def install() -> DiskPrograms:
  """Put a DiskPrograms in place of tinygrad's to_program_cache (its entries so far kept); once per process."""
  import tinygrad.codegen as codegen, tinygrad.engine.realize as realize
  cache = DiskPrograms()
  dict.update(cache, codegen.to_program_cache)
  codegen.to_program_cache = realize.to_program_cache = cache
  return cache
