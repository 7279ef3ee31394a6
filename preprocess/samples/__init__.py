"""Built-in sample data (`loongforge sample-data`): dataset (the LeRobot v2.x generator),
camera (camera-model footage), layouts (v2.1 / v3.0 rewrites), learnable (the learnable task)."""
