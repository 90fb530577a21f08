"""Server processes: the HTTP front end and the `serve` command."""
