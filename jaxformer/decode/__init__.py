"""jaxformer.decode"""
