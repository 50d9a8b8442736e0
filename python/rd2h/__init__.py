"""rd2h: layerwise KV-cache transfer for prefill/decode disaggregated serving.

The native module is the connector's public face (configuration, the scheduler-role and
worker-role facades, the proxy); ``rd2h.vllm`` is the KV Connector V1 class vLLM loads.
"""

from rd2h._native import (  # noqa: F401
    CacheLayer,
    CacheTensor,
    ConnectorConfig,
    Error,
    HostWriteEvent,
    InvalidArgument,
    KvCacheGroup,
    KvRole,
    Parallel,
    PeerError,
    Proxy,
    Scheduler,
    Timeout,
    Worker,
    __version__,
)
