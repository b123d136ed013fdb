"""What both ends of a weight transfer share: the trainer's transports (``rollsafe.transports``)
send with it, the reference engine receives with it, and neither imports the other.

Imports only torch and numpy (safetensors for a single file's header); importing this package
imports none of its modules:

* :mod:`.bucket`: SGLang's flattened-bucket wire format (pack, serialize, checked decode);
* :mod:`.delta`: delta weight sync as named tensors (encode, checked apply);
* :mod:`.unpickle`: the restricted unpickler payloads decode through;
* :mod:`.shm`: the shared-memory namespace CPU buckets travel in;
* :mod:`.dtypes`: dtype names on the wire and element sizes;
* :mod:`.copy`: :func:`~rollsafe.wire.copy.copy_pairs`, batched tensor copies;
* :mod:`.hf_index`: the HF safetensors index, read one way by every reader;
* :mod:`.group`: the weight-update process group trainer and engine ranks join;
* :mod:`.group_names`: the name each end joins a group under (fixed for vLLM's one group);
* :mod:`.vllm_group`: rank 0 of a real vLLM's ``nccl`` weight-transfer group (vLLM's own
  ``StatelessProcessGroup`` + PyNccl join);
* :mod:`.lines`: the ``ROLLSAFE_READY`` / ``ROLLSAFE_STANDBY`` start-up lines;
* :mod:`.strict_json`: the one strict JSON parser, for export files and engine request bodies.
"""
