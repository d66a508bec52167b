"""The storage wing: where each unit's host bytes live and how they reach a flat buffer the engine can copy.

Beside the streaming core (`flextensor_diffusers.engine`): the core decides *when* a unit's bytes must be on the
device; this package owns *where* they are on the host and in what form: raw copies in (page-locked) RAM
(`host_copies`, `host_memory`, `locked_pool`, `packing_line`), lossless payloads (`codec`, `compressed_copies`,
`device_encoding`, `payload_cache`, `arrivals`), raw copies on disk and the weight files they come from
(`raw_homes`, `raw_home`, `weight_files`, `disk_reads`, `file_reads`, `cache_files`, `private_files`), copies shared
between processes (`shared_host`), the machine's memory (`machine_memory`), the pipeline-wide host budget
(`host_budget`) and the tier that reads components back from disk while others compute (`host_tier`).
"""
