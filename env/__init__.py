"""The trace-replay simulator of SGLang speculative decoding and its gymnasium environment.

Importing this package registers ``specctl/SpecDecode-v0``.
"""

import gymnasium

gymnasium.register(id="specctl/SpecDecode-v0", entry_point="env.spec_env:SpecDecodeEnv")
