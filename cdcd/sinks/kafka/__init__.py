"""The Kafka sink (``type: kafka``): a record per change event on a per-table topic.
:mod:`~cdcd.sinks.kafka.sink` is the sink; it writes record batches itself
(:mod:`~cdcd.sinks.kafka.recordbatch`, :mod:`~cdcd.sinks.kafka.batches`), hands them to aiokafka
and follows their acknowledgements (:mod:`~cdcd.sinks.kafka.sender`, with
:mod:`~cdcd.sinks.kafka.client`); ``exactly_once``: :mod:`~cdcd.sinks.kafka.exactly_once` and
:mod:`~cdcd.sinks.kafka.position`."""
