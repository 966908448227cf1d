"""The Kafka sink (``type: kafka``): a record per change event on a per-table topic.
:mod:`~cdcd.sinks.kafka.sink` is the sink; it writes record batches itself
(:mod:`~cdcd.sinks.kafka.recordbatch`, :mod:`~cdcd.sinks.kafka.batches`) and sends them with
aiokafka (:mod:`~cdcd.sinks.kafka.client`)."""
