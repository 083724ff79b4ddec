"""The fork server's first import (`envoykit.runtime.forkserver.PRELOAD`): torch, then the engine's
logging config.

vLLM applies the config when it is imported, and torch resets its own loggers when it is
first imported; in the fork server, whose imports run in that order, the notes torch logs
while vLLM registers its ops ("Triton not available") reached the owner's stderr, in a
notebook its output. With torch imported and the config applied first they go to the log
file, as in the owner.
"""

import torch  # noqa: F401

from envoykit.runtime import logs

logs.apply_engine_config()
