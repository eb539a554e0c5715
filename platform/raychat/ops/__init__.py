"""Cluster operations: Ray job submission, KubeRay RayJobs, Grafana provisioning."""
