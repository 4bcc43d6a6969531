"""The adapter core: what both Lightning faces (the Trainer's ``strategies`` and Fabric's ``fabric``) share.

Argument checks and their messages (``arguments``), each strategy's options parsed into what its plain-PyTorch
wrapper takes (``ddp_options``, ``fsdp_options``), the process group on a restart-safe store (``process_group``),
the registration of the strategies' names (``registry``), the fp16 scaler of a split model (``precision``), and
checkpoints: atomic files and folders (``checkpoint_files``), Lightning's ``CheckpointIO`` and its checks
(``checkpoint_io``), the sharded folder with its ``meta.pt`` (``sharded_folder``). It imports the plain layer and
Lightning's ``fabric`` utilities, never a face; each face imports it, never the other face.
"""
