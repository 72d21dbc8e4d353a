"""Examples: networks (LeNet-5, ResNet-20/18, AlexNet), datamodules, the run summary and the demo.

Datamodules read the standard dataset files from a directory the user gives (MNIST IDX files,
CIFAR-10 python batches) or build their task in (the teacher task of the quickstart); nothing is
downloaded.
"""
