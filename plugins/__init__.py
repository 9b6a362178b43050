"""kvexport.plugins: TensorRT plugins (paged / GQA / INT8-KV attention). Not implemented
yet; the op name, namespace and version are reserved in kvexport.io (PLUGIN_*)."""
