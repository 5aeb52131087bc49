"""Pure, clock-free pieces of the engine model that engine_sim and the simulator share (one copy each)."""

from shared.engine.prefix_blocks import prompt_blocks, text_blocks, token_blocks
from shared.engine.prefix_cache import BLOCK_TOKENS, CacheHold, PrefixCache, reuse_bound

__all__ = ["BLOCK_TOKENS", "CacheHold", "PrefixCache", "prompt_blocks", "reuse_bound", "text_blocks", "token_blocks"]
