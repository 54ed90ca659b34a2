"""The EBS direct APIs (service ``ebs``, rest-json, on the controller's endpoint): snapshots written and
read block by block, as AWS's backup tools do (docs/ebs-direct.md).

- ``api``: the six routes, SigV4 for ``ebs`` (or a bearer key), AWS's JSON answers and errors;
- ``writes``: StartSnapshot, PutSnapshotBlock, CompleteSnapshot (the blocks go through a storage agent
  into the snapshot store; the controller records which block went to which chunk);
- ``reads``: ListSnapshotBlocks, ListChangedBlocks, GetSnapshotBlock;
- ``tokens``: block tokens and page tokens; ``errors``: AWS's error shapes.
"""
