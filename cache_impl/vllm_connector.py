"""The vLLM KV connector at the module path vLLM configs name (`kv_connector_module_path: cache_impl.vllm_connector`);
it lives in `cache_impl.vllm.vllm_connector`."""

from cache_impl.vllm.vllm_connector import KvgateConnector

__all__ = ["KvgateConnector"]
