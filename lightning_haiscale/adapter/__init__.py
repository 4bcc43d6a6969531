"""The adapter core: what both Lightning faces (the Trainer's ``strategies`` and Fabric's ``fabric``) share.

It imports the plain layer and Lightning's ``fabric`` utilities, never a face; each face imports it, never the
other face.

- ``arguments``: argument checks and their messages, at construction.
- ``ddp_options``: hai_ddp's options, parsed once, and its wrapper.
- ``fsdp_options``: Lightning ``FSDPStrategy``'s keywords, checked once and turned into the wrapper's options.
- ``process_group``: the process group, on a store that a torchrun restart cannot confuse.
- ``collectives``: the collectives Lightning asks of a strategy, whose gloo works outlive the call.
- ``registry``: the strategies' names, registered once in Lightning's registries.
- ``precision``: the fp16 loss scaler of a model split across ranks.
- ``checkpoint_files``: atomic checkpoint files and folders.
- ``checkpoint_io``: a file saved through Lightning's ``CheckpointIO``, and the checks of a load.
- ``sharded_folder``: the sharded folder with its ``meta.pt``, in Lightning's layout.
"""
