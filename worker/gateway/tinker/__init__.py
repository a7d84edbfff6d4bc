"""The Tinker SDK's sampling API (``/api/v1/...``) on the gateway: ``routes`` (the routes and
sessions), ``plan`` (a ``SampleRequest`` as one scored sequence and its answer arrays),
``images`` (a prompt's ``ImageChunk``s as the job's images and image-token runs), ``futures``
(a job per ``asample``, kept until retrieved), ``wire`` (the SDK's request models, its protobuf
``SampleResponse``) and ``protobuf`` (the wire encoding)."""
