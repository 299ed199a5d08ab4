"""Landing notices: a transport write into a decode node's blocks carries a 32-bit value (verbs: the immediate of
WRITE_WITH_IMM; tcp, shm: the notice frame) that says which sequence's which layer has landed: (seq_id << LAYER_BITS) | layer.
The sender (tinyhet.kv.sender) makes them, the decode node (tinyhet.engine.decode_node) counts them."""
LAYER_BITS = 8            # layers per model: at most 255
MAX_SEQ_ID = 1 << (32 - LAYER_BITS)

def notice_value(seq_id: int, layer: int) -> int: return (seq_id << LAYER_BITS) | layer
def split_notice(value: int) -> tuple[int, int]: return value >> LAYER_BITS, value & ((1 << LAYER_BITS) - 1)
