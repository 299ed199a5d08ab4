"""Landing notices: a transport write into a decode node's blocks carries a 32-bit value (verbs: the immediate of
WRITE_WITH_IMM; tcp, shm: the notice frame) that says which piece of which layer of which sequence has landed.

Format 2 (NOTICE_FORMAT; decode.info says it, tinyhet.engine.checks.check_compatible refuses a peer of another format):
  (seq_id << 17) | (layer << 9) | (piece << 1) | last
A layer arrives in pieces 0..k (a chunked prefill sends each chunk's blocks as soon as that chunk's layer is computed), the
last one flagged; a layer sent whole is piece 0, last. Format 1 was (seq_id << 8) | layer.

The sender (tinyhet.kv.sender) makes them; the decode node (tinyhet.engine.decode_node) keeps a Landing per sequence: a
layer has landed once its last piece and every piece before it have. Notices are network input: a piece past a layer's
known last one, or a second, different last piece, is refused (Landing.add returns False); a repeat of one already counted
is harmless (a resend after a broken link sends every piece again)."""
NOTICE_FORMAT = 2
LAYER_BITS = 8            # layers per model: at most 255
PIECE_BITS = 8            # pieces per layer: at most 256
MAX_PIECES = 1 << PIECE_BITS
SEQ_SHIFT = LAYER_BITS + PIECE_BITS + 1
MAX_SEQ_ID = 1 << (32 - SEQ_SHIFT)

def notice_value(seq_id: int, layer: int, piece: int = 0, last: bool = True) -> int:
  if not (0 <= seq_id < MAX_SEQ_ID and 0 <= layer < 1 << LAYER_BITS and 0 <= piece < MAX_PIECES):
    raise ValueError(f"notice_value: seq_id {seq_id}, layer {layer} or piece {piece} out of range")
  return (seq_id << SEQ_SHIFT) | (layer << (PIECE_BITS + 1)) | (piece << 1) | int(bool(last))

def split_notice(value: int) -> tuple[int, int, int, bool]:
  """(seq_id, layer, piece, last) of a notice value (any 32-bit value splits; the receiver checks each field)."""
  return value >> SEQ_SHIFT, (value >> (PIECE_BITS + 1)) & ((1 << LAYER_BITS) - 1), (value >> 1) & (MAX_PIECES - 1), bool(value & 1)

class Landing:
  """Which pieces of a sequence's layers have landed."""
  def __init__(self, n_layers: int):
    self.n_layers = n_layers
    self.pieces: dict[int, set[int]] = {}   # layer -> pieces landed
    self.last: dict[int, int] = {}          # layer -> its last piece, once that has landed
    self.done: set[int] = set()             # layers every piece of which has landed

  def add(self, layer: int, piece: int, last: bool) -> bool:
    """Count a notice; False (nothing counted) for a layer the model lacks, a piece past the layer's last one, or a last
    piece that contradicts the pieces or the last one seen."""
    if not 0 <= layer < self.n_layers: return False
    seen, end = self.pieces.setdefault(layer, set()), self.last.get(layer)
    if end is not None and (piece > end or (last and piece != end)): return False
    if last and end is None and seen and max(seen) > piece: return False
    seen.add(piece)
    if last: self.last[layer] = piece
    if layer in self.last and len(seen) == self.last[layer] + 1: self.done.add(layer)
    return True

  def complete(self) -> bool: return len(self.done) == self.n_layers
  def __len__(self) -> int: return len(self.done)       # layers landed
