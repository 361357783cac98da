"""``mpgemm train``, the application: an MLP trained in FP32, under autocast and with
mpgemm on the same batches, timed and reported (``cli``, ``data``, ``train``,
``report``). Its dependencies (scikit-learn, tqdm, matplotlib) are the ``train``
extra: ``pip install 'mpgemm[train]'``. The library (``import mpgemm``) needs none of
them."""
