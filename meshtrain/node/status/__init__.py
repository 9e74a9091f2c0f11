"""What a node tells its operator: the status document (`document`: `/status`, `/metrics`), its
HTTP server (`server`, with `dashboard.html`) and client (`client`), the terminal console
(`console`) and loss plots (`plot`)."""
