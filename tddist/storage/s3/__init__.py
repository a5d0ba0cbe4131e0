"""Checkpoints on S3-compatible object storage (``s3://bucket/key`` and ``s3://bucket/key.tdz``).

``url`` parses the prefixes; ``client`` makes the boto3 client (imported only
when an ``s3://`` prefix is used) and turns its errors into tddist's;
``pin`` opens a committed checkpoint once and reads its manifest;
``files`` reads chunks with ranged GETs; ``directory`` and ``archive`` are the
two layouts' ``ShardWriter``s; ``recovery`` removes what interrupted saves
left. The object layout is specified in docs/format.md ("Object storage").
"""
