"""The fork server's last import (`envoykit.runtime.forkserver.PRELOAD`): it freezes the heap
the imports before it built.

A full collection visits every tracked object: in a process forked from the fork server,
650,000 of them from the imports alone, 0.35 s a collection on two cores. vLLM collects
several times while a rank starts (after it loads its weights, twice, and around its memory
profile) and once as the engine core becomes ready, each on the start's critical path.
Frozen (``gc.freeze``), the imported objects sit in the permanent generation, which forked
children inherit and collections skip: a collection then visits only what the engine made
since. They are modules, classes and functions that live as long as the process anyway;
what vLLM's teardown unfreezes (``gc.unfreeze``) is collected as the core leaves.
"""

import gc

gc.freeze()
