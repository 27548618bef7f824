from . import caffe_pb2

__all__ = ["caffe_pb2"]
