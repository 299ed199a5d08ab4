"""The disk tier on a real decode node process (tinyhet.kv.disk_tier under DecodeNode.disk): greedy tokens with the tier
equal those without it on a pool small enough to evict, and a node killed with SIGKILL and started again on the same
folder finds its spilled blocks, so a repeated prompt's first request hits (usage cached_tokens counts it). The restart
runs a real `tinyhet node --kv-disk` (its fingerprint of a `random:` model, its warm-up, its threads), as a user would."""
import json, os, signal, subprocess, sys, time
from tinyhet.config import load_config
from tinyhet.runtime.control import ControlClient
from tinyhet.runtime.transport import Endpoint
from test_e2e import DECODE_NODE, SMALL, TOKEN

TIER = '''
from tinyhet.service.node_roles import install_submit
install_submit(decode)
if {disk!r}:
  from tinyhet.kv.disk_tier import DiskTier
  decode.disk = DiskTier(decode.cache, {disk!r}, 64 << 20)
'''
PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(22)] for i in range(6)]   # 6 prompts of 22 tokens: 5 full blocks of 4 each

RANDOM = "random:" + ",".join(f"{k}={v}" for k, v in SMALL.items())

class Node:
  def __init__(self, disk: str = "", blocks: int = 24, cli: bool = False):
    env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_NODE": "disk-decode", "TINYHET_ARENA_BYTES": "256M", "TINYHET_KV_BLOCK_SIZE": "4"}
    if cli:     # the command a user runs: 1 KiB a block (2 layers of 4 tokens), so --kv-memory gives `blocks` blocks
      argv = ["-m", "tinyhet", "node", "--role", "decode", "--listen", "127.0.0.1:0", "--quiet", "--stdin-stop", "--model", RANDOM,
              "--kv-memory", f"{blocks}K", "--kv-disk", disk, "--kv-disk-size", "64M"]
    else:
      script = DECODE_NODE.format(small=SMALL, blocks=blocks, bs=4)
      argv = ["-c", script.replace("print(json.dumps(", TIER.format(disk=disk) + "print(json.dumps(")]
    self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = self.proc.stdout.readline()
    if not line: raise RuntimeError(f"decode node did not start (exit {self.proc.wait()})")
    self.ep = Endpoint("disk-client", token=TOKEN, config=load_config(env={}))
    self.address = json.loads(line)["address"]
    self.ctl = ControlClient(self.ep, self.address)

  def greedy(self, prompt) -> tuple[list[int], int]:
    """The prompt's 6 greedy tokens and its cached_tokens."""
    out, cached = [], None
    for item in self.ctl.stream("decode.submit", prompt_ids=list(prompt), max_new_tokens=6):
      if "token" in item: out.append(item["token"])
      if item.get("done"): cached = item["cached_tokens"]
    return out, cached

  def info(self) -> dict: return self.ctl.call("decode.info")

  def wait_info(self, ok, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(info := self.info()):
      if time.monotonic() > deadline: raise TimeoutError(f"decode.info never got there: {info}")
    return info

  def close(self, kill: bool = False):
    self.ctl.close()
    self.ep.close()
    if kill: self.proc.send_signal(signal.SIGKILL)
    else: self.proc.stdin.close()
    self.proc.wait(30)

def test_tier_never_changes_tokens_and_a_restart_hits(tmp_path):
  plain, tiered = Node(), Node(str(tmp_path))
  try:
    for rnd in range(2):                # the second round repeats every prompt: the pool (24 blocks) held only the last few
      for p in PROMPTS:
        want, _ = plain.greedy(p)
        got, cached = tiered.greedy(p)
        assert got == want, f"round {rnd}: the tier changed the tokens of prompt {p[:3]}"
    info = tiered.info()
    assert info["disk_hit_tokens"] > 0 and info["disk_written_bytes"] > 0, info
    assert info["prefix_hit_tokens"] >= info["disk_hit_tokens"]       # usage's cached tokens count disk hits
  finally: plain.close()
  tiered.wait_info(lambda i: i["disk_blocks"] >= 5)   # the writer's first batches are on disk (then SIGKILL)
  tiered.close(kill=True)
  again = Node(str(tmp_path))
  try:
    _, cached = again.greedy(PROMPTS[0])
    assert cached >= 4, "the restarted node did not find the first prompt's blocks on disk"
    assert again.info()["disk_hit_tokens"] == cached
  finally: again.close()

def test_a_real_node_restarted_on_its_folder_hits(tmp_path):
  """`tinyhet node --kv-disk` twice on one folder, SIGKILL between: the first node's spilled blocks (keyed by the model's
  fingerprint, as the CLI computes it) are what the second finds for the same prompt."""
  first = Node(str(tmp_path), cli=True)
  try:
    for rnd in range(2):                # a 24-block pool: the second round finds the first prompts on disk only
      for p in PROMPTS: first.greedy(p)
    info = first.wait_info(lambda i: i["disk_blocks"] >= 5)
    assert info["disk_hit_tokens"] > 0 and info["kv_blocks"] <= 24, info
    want, _ = first.greedy([*PROMPTS[0][:21], 9])      # a prompt of the first one's blocks, once more
  finally: first.close(kill=True)
  again = Node(str(tmp_path), cli=True)
  try:
    assert again.info()["cache_key"] == info["cache_key"]     # the same fingerprint in another process: the same folder
    got, cached = again.greedy([*PROMPTS[0][:21], 9])
    assert cached >= 4, f"the restarted node found none of the prompt's blocks on disk ({again.info()})"
    assert got == want and again.info()["disk_hit_tokens"] == cached
  finally: again.close()
