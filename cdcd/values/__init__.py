"""Value codecs: PostgreSQL values (text or binary form, by type OID) to JSON-ready and native
Python values. Used by the event encoders, not by the decoder, which hands values on as bytes."""
