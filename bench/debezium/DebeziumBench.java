/*
 * bench/run.py's debezium_null and debezium_kafka contenders: Debezium's PostgreSQL connector
 * (pgoutput) in its asynchronous embedded engine, records converted to JSON without schemas.
 *
 * Usage: java -cp <jars of scripts/maven/debezium>:<classes> DebeziumBench <file.properties>
 *
 * The properties file holds the engine's and the connector's properties as they are, and the
 * bench's own, all prefixed "bench.":
 *
 *   bench.rows              the row changes to wait for (data records, the sentinel table's apart)
 *   bench.sink              null (count, discard) or kafka
 *   bench.kafka.*           with bench.sink=kafka: KafkaProducer properties (bootstrap.servers,
 *                           acks, enable.idempotence, ...); each record goes to the topic the
 *                           connector names (<topic.prefix>.<schema>.<table>), key and value the
 *                           converter's JSON; a topic is created (one partition, the broker's
 *                           replication factor) before its first record, as Kafka Connect's
 *                           topic creation does, for a broker that creates none itself
 *   bench.timeout.seconds   give up (exit 3) when the count is not reached in this time
 *
 * Once bench.rows data records were handled (into Kafka: acknowledged), it prints one JSON line
 * on stdout and exits 0: rows, seconds (first record to last, or to the last acknowledgement),
 * startup_seconds (JVM start to first record), cpu_seconds_at_first (the process's CPU time
 * then), records_seen and bytes (key + value JSON). More records than bench.rows, or a failed
 * send, is an error (exit 2). DEBEZIUM_BENCH_DEBUG set in the environment: each batch's size and
 * time on stderr.
 */

import io.debezium.engine.ChangeEvent;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.format.Json;
import java.io.FileReader;
import java.io.Reader;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.errors.TopicExistsException;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class DebeziumBench {
    private static final String ASYNC = "io.debezium.embedded.async.ConvertingAsyncEngineBuilderFactory";

    private static final boolean DEBUG = System.getenv("DEBEZIUM_BENCH_DEBUG") != null;
    private final long wanted;
    private final String sentinel; // a topic suffix: its records are not counted
    private final KafkaProducer<byte[], byte[]> producer; // null: the null handler
    private final Admin admin; // with the producer: creates each topic once
    private final Set<String> topics = ConcurrentHashMap.newKeySet();
    private final AtomicLong seen = new AtomicLong();
    private final AtomicLong acked = new AtomicLong();
    private final AtomicLong bytes = new AtomicLong();
    private final AtomicReference<String> failure = new AtomicReference<>();
    private final CountDownLatch done = new CountDownLatch(1);
    private volatile long firstNanos;
    private volatile long lastNanos;
    private volatile long cpuAtFirst;

    private DebeziumBench(long wanted, String sentinel, KafkaProducer<byte[], byte[]> producer, Admin admin) {
        this.wanted = wanted;
        this.sentinel = sentinel;
        this.producer = producer;
        this.admin = admin;
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: DebeziumBench <file.properties>");
            System.exit(64);
        }
        Properties all = new Properties();
        try (Reader in = new FileReader(args[0], StandardCharsets.UTF_8)) {
            all.load(in);
        }
        Properties engine = new Properties();
        Properties kafka = new Properties();
        for (String name : all.stringPropertyNames()) {
            if (name.startsWith("bench.kafka.")) {
                kafka.setProperty(name.substring("bench.kafka.".length()), all.getProperty(name));
            }
            else if (!name.startsWith("bench.")) {
                engine.setProperty(name, all.getProperty(name));
            }
        }
        long wanted = Long.parseLong(required(all, "bench.rows"));
        String sink = required(all, "bench.sink");
        long timeout = Long.parseLong(all.getProperty("bench.timeout.seconds", "3600"));
        KafkaProducer<byte[], byte[]> producer = null;
        Admin admin = null;
        if (sink.equals("kafka")) {
            producer = new KafkaProducer<>(kafka, new ByteArraySerializer(), new ByteArraySerializer());
            Properties adminProps = new Properties();
            adminProps.setProperty("bootstrap.servers", required(kafka, "bootstrap.servers"));
            admin = Admin.create(adminProps);
        }
        else if (!sink.equals("null")) {
            throw new IllegalArgumentException("bench.sink: null or kafka, not " + sink);
        }
        DebeziumBench bench = new DebeziumBench(wanted, "." + all.getProperty("bench.sentinel", "public.bench_sentinel"), producer, admin);
        System.exit(bench.run(engine, timeout));
    }

    private static String required(Properties props, String name) {
        String value = props.getProperty(name);
        if (value == null) {
            throw new IllegalArgumentException("missing property " + name);
        }
        return value;
    }

    private int run(Properties engineProps, long timeoutSeconds) throws Exception {
        AtomicReference<Throwable> engineError = new AtomicReference<>();
        DebeziumEngine<ChangeEvent<String, String>> engine = DebeziumEngine
                .create(Json.class, Json.class, Json.class, ASYNC)
                .using(engineProps)
                .using((success, message, error) -> {
                    if (!success) {
                        engineError.set(error != null ? error : new RuntimeException(message));
                        done.countDown();
                    }
                })
                .notifying(this::handleBatch)
                .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        boolean finished = done.await(timeoutSeconds, TimeUnit.SECONDS);
        if (producer != null && finished && failure.get() == null && engineError.get() == null) {
            producer.flush(); // every send acknowledged (or failed) before the clock stops
            lastNanos = System.nanoTime();
        }
        String figures = figures();
        engine.close();
        executor.shutdown();
        executor.awaitTermination(30, TimeUnit.SECONDS);
        if (producer != null) {
            producer.close();
            admin.close();
        }
        if (engineError.get() != null) {
            engineError.get().printStackTrace();
            return 2;
        }
        if (failure.get() != null) {
            System.err.println(failure.get());
            return 2;
        }
        if (!finished) {
            System.err.println("timed out after " + timeoutSeconds + " s: " + seen.get() + " of " + wanted + " rows");
            return 3;
        }
        if (producer != null && acked.get() != wanted) {
            System.err.println("acknowledged " + acked.get() + " of " + wanted + " rows");
            return 2;
        }
        System.out.println(figures);
        System.out.flush();
        return 0;
    }

    private void handleBatch(List<ChangeEvent<String, String>> records,
                             DebeziumEngine.RecordCommitter<ChangeEvent<String, String>> committer)
            throws InterruptedException {
        if (DEBUG) {
            System.err.printf("batch %d at %.3f%n", records.size(), System.nanoTime() / 1e9);
        }
        for (ChangeEvent<String, String> record : records) {
            String value = record.value();
            if (value != null && !record.destination().endsWith(sentinel)) {
                if (firstNanos == 0) {
                    firstNanos = System.nanoTime();
                    cpuAtFirst = processCpuNanos();
                }
                String key = record.key();
                byte[] k = key == null ? null : key.getBytes(StandardCharsets.UTF_8);
                byte[] v = value.getBytes(StandardCharsets.UTF_8);
                bytes.addAndGet((k == null ? 0 : k.length) + v.length);
                if (producer != null) {
                    createTopic(record.destination());
                    producer.send(new ProducerRecord<>(record.destination(), k, v), (meta, error) -> {
                        if (error != null) {
                            failure.compareAndSet(null, "send to " + record.destination() + " failed: " + error);
                            done.countDown();
                        }
                        else {
                            acked.incrementAndGet();
                        }
                    });
                }
                long n = seen.incrementAndGet();
                if (n > wanted) {
                    failure.compareAndSet(null, "more rows than the " + wanted + " wanted");
                    done.countDown();
                }
                else if (n == wanted) {
                    lastNanos = System.nanoTime();
                    done.countDown();
                }
            }
            committer.markProcessed(record);
        }
        committer.markBatchFinished();
    }

    private void createTopic(String topic) throws InterruptedException {
        if (topics.contains(topic)) {
            return;
        }
        try {
            admin.createTopics(List.of(new NewTopic(topic, Optional.of(1), Optional.empty()))).all().get();
        }
        catch (ExecutionException error) {
            if (!(error.getCause() instanceof TopicExistsException)) {
                throw new IllegalStateException("creating topic " + topic + " failed", error.getCause());
            }
        }
        topics.add(topic);
    }

    private String figures() {
        long startMillis = ManagementFactory.getRuntimeMXBean().getStartTime();
        // nanoTime has no epoch: the JVM's start in its terms is now minus the time since then
        long startNanos = System.nanoTime() - (System.currentTimeMillis() - startMillis) * 1_000_000L;
        return String.format(
                "{\"rows\": %d, \"seconds\": %.6f, \"startup_seconds\": %.3f, \"cpu_seconds_at_first\": %.3f, \"bytes\": %d, \"acked\": %d}",
                seen.get(),
                (lastNanos - firstNanos) / 1e9,
                (firstNanos - startNanos) / 1e9,
                cpuAtFirst / 1e9,
                bytes.get(),
                acked.get());
    }

    private static long processCpuNanos() {
        java.lang.management.OperatingSystemMXBean os = ManagementFactory.getOperatingSystemMXBean();
        if (os instanceof com.sun.management.OperatingSystemMXBean sun) {
            return sun.getProcessCpuTime();
        }
        return 0;
    }
}
