"""kvtier inside vLLM: an out-of-tree offloading spec for vLLM's OffloadingConnector.

- `spec.KvtierOffloadingSpec`: the spec (`spec_name`, `spec_module_path` in
  `kv_connector_extra_config`);
- `connector.KvtierConnector`: OffloadingConnector that reports failed loads as failed;
- `manager.KvtierManager` (scheduler side, kvtier's index) and `worker.KvtierWorker` (worker
  side, kvtier's tiers);
- `config`: the `kvtier.*` keys; `engine_groups`: kvtier geometries of vLLM's KV-cache groups.

Importing this package does not import vLLM; its modules do.
"""

SPEC_NAME = "KvtierOffloadingSpec"
SPEC_MODULE = "kvtier.integrations.vllm.spec"
CONNECTOR_NAME = "KvtierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm.connector"
