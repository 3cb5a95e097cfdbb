"""Image builder: probes a base image's real contents, builds and labels the port image."""
