"""Chat-side tools: replay records of SFT batches and the `raychat inspect-batch` canary printer."""
