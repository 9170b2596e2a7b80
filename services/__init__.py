"""asyncrl services. The public plugin surface is services.api."""
