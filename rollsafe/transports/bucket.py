"""Old import path of the bucket wire format, now :mod:`rollsafe.wire.bucket` (an alias).

Both ends of a transport share the format, so it lives in the neutral :mod:`rollsafe.wire`;
every name importable here before is importable here still.
"""

from rollsafe.wire.bucket import (
    DEFAULT_BUCKET_BYTES,
    PAYLOAD_FORMAT,
    SGLANG_METADATA_GLOBAL,
    BucketFormatError,
    FlatBucket,
    FlattenedTensorMetadata,
    TensorMeta,
    WireBucket,
    _metadata_ops,
    _shared_copy,
    deserialize_payload,
    dtype_from_name,
    dtype_name,
    pack_buckets,
    packed_chunks,
    serialize_bucket,
    serialize_named_tensors,
    unpack_bucket,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PAYLOAD_FORMAT",
    "SGLANG_METADATA_GLOBAL",
    "BucketFormatError",
    "FlatBucket",
    "FlattenedTensorMetadata",
    "TensorMeta",
    "WireBucket",
    "_metadata_ops",
    "_shared_copy",
    "deserialize_payload",
    "dtype_from_name",
    "dtype_name",
    "pack_buckets",
    "packed_chunks",
    "serialize_bucket",
    "serialize_named_tensors",
    "unpack_bucket",
]
