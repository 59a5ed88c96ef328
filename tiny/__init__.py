"""The tiny world: a from-scratch tiny VLM, synthetic shapes data and the small models trained on them, so every
recipe runs on a CPU (docs/tiny.md).

tiny/ stands above the library: it imports utils/ and rewards/, which never import it. Importing `tiny` (every
script does) adds the world to them: its model and data set names to utils.core.names (so `tiny-sft` or
`synthetic:shapes` resolve to folders built on first use, tiny/cache.py) and the `shapes_t2i` reward to the reward
registry (tiny/shapes_reward.py).
"""

import rewards
from tiny import cache
from tiny.shapes_reward import shapes_t2i_reward
from utils.core import names

names.register(model=cache.resolve_tiny_name, dataset=cache.resolve_dataset)
if "shapes_t2i" not in rewards.list_rewards():
    rewards.register("shapes_t2i", shapes_t2i_reward)
