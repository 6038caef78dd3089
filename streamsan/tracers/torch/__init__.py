"""The torch tracer (:class:`.tracer.TorchTracer`): turns a live PyTorch program into streamsan events.

What it watches:

* every aten op, through a ``TorchDispatchMode`` (:mod:`.dispatch`, its common case in C: :mod:`.ccore`, entered
  without PyTorch's Python dispatch through the native dispatch lane where it is built: :mod:`.lane`): its
  read and write sets from the schema's alias information (:mod:`.rules`: in-place and ``out=`` arguments are
  writes, fresh outputs are writes, view and metadata-only arguments are not accesses; optional tensors are), as
  byte ranges of device memory or pinned host memory, on the stream current at dispatch; ops on pinned CPU tensors
  with no CUDA tensor involved are host accesses. Where the schema does not tell, the op's own ops are traced
  instead: composite ops that inference mode hands over whole (``to``, ``reshape``, ``dropout``... through their
  C++ kernel) and ops implemented in Python (custom ops, with the mode on; one access by their schema too where
  their own work is not seen); batch norm writes its running statistics in training;
* events, waits, synchronizations, allocations and frees, through PyTorch's GPU trace callbacks
  (:mod:`.callbacks`);
* what those miss (:mod:`.patches`): ``record_stream`` (an aten op), ``Event.query()`` / ``Stream.query()``
  returning True, copies into pageable host memory (CUDA returns only after them: modelled as a host sync),
  pinned allocations (outputs of pinning ops and of non-blocking device-to-host copies), host reads that launch
  no aten op (``Tensor.tolist()``; ``Tensor.numpy()`` views, which report their accesses as they happen, and read
  when the array is gone) on pinned memory (:mod:`.host_memory`), ``record_stream`` under ``no_dispatch()``,
  ``UntypedStorage.resize_``, and ``torch.cuda.use_mem_pool`` (the allocations it routes to a private pool carry
  the pool: :mod:`.allocators`);
* CUDA graphs: ops during capture are kept as the graph's accesses, and each ``replay()`` is one op on the
  replaying stream (:mod:`.cuda_graphs`);
* host writes to pinned staging buffers that no traced call shows, by the bytes they change at the next
  asynchronous copy out of the same place (:mod:`streamsan.tracers.staging`).

It never synchronizes, waits on events, reads device memory or changes streams (docs/semantics.md): it reads
tensor metadata and stream handles, and the bytes of small pinned host buffers that asynchronous copies read.
Events fired inside an op (its allocations, the synchronization of a blocking copy) are placed around the op's own
event so that allocations precede the op and syncs follow it (:mod:`.placement`). A collective that runs on a
communication stream of its own keeps its tensors alive until it has run (modelled as ``record_stream`` on that
stream).
"""
