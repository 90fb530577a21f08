"""Where workers run and how the router reaches them: supervisor, Ray, remote connectors."""
