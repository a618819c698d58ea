"""jaxformer.train"""
