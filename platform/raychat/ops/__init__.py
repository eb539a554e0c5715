"""Cluster operations: Ray job submission, KubeRay manifests, Grafana dashboards."""
