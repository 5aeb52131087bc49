"""Pure, clock-free engine model that engine_sim and the simulator share (one copy each): the scheduler in
shared/engine/model.py (imported from there, not re-exported), the radix prefix cache and the prefix identity."""

from shared.engine.prefix_blocks import prompt_blocks, text_blocks, token_blocks
from shared.engine.prefix_cache import BLOCK_TOKENS, CacheHold, PrefixCache, reuse_bound

__all__ = ["BLOCK_TOKENS", "CacheHold", "PrefixCache", "prompt_blocks", "reuse_bound", "text_blocks", "token_blocks"]
