"""asyncrl's built-in inference engine: a torch server speaking the SGLang HTTP protocol subset."""
