//! The store's commands against Redis's behaviour: replies, errors, recorded changes.

#![allow(clippy::unwrap_used)]
use super::args::{bulk, glob};
use super::*;

fn run(db: &mut Db, line: &str) -> Result<Value, CommandError> {
    let args: Vec<Vec<u8>> = line.split(' ').map(|s| s.as_bytes().to_vec()).collect();
    db.execute(&args)
}

fn strings(v: Value) -> Vec<String> {
    match v {
        Value::Array(items) => items
            .into_iter()
            .map(|i| match i {
                Value::BulkString(b) => String::from_utf8(b).unwrap(),
                other => panic!("{other:?}"),
            })
            .collect(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn zpopmin_takes_the_lowest_and_is_recorded_as_their_removal() {
    let mut db = Db::default();
    run(&mut db, "ZADD z 2 b 1 c 2 a").unwrap();
    db.clear_changes();
    assert_eq!(
        strings(run(&mut db, "ZPOPMIN z 2").unwrap()),
        ["c", "1", "a", "2"]
    );
    assert_eq!(
        db.take_changes(),
        [["ZREM", "z", "c", "a"]
            .map(|s| s.as_bytes().to_vec())
            .to_vec()]
    );
    assert_eq!(strings(run(&mut db, "ZPOPMIN z").unwrap()), ["b", "2"]);
    assert_eq!(db.key_count(), 0, "the emptied set is gone");
    assert!(strings(run(&mut db, "ZPOPMIN z 5").unwrap()).is_empty());
    assert!(
        db.take_changes().len() == 1,
        "popping nothing records nothing"
    );
}

#[test]
fn sorted_sets_order_by_score_then_member_and_ranges_follow_redis() {
    let mut db = Db::default();
    run(&mut db, "ZADD z 2 b 1 c 2 a 3 d").unwrap();
    assert_eq!(
        strings(run(&mut db, "ZRANGE z 0 -1").unwrap()),
        ["c", "a", "b", "d"]
    );
    assert_eq!(
        strings(run(&mut db, "ZRANGE z -2 -1 WITHSCORES").unwrap()),
        ["b", "2", "d", "3"]
    );
    assert_eq!(
        strings(run(&mut db, "ZRANGEBYSCORE z (1 2").unwrap()),
        ["a", "b"]
    );
    assert_eq!(
        strings(run(&mut db, "ZRANGEBYSCORE z -inf +inf LIMIT 1 2").unwrap()),
        ["a", "b"]
    );
    assert_eq!(
        strings(run(&mut db, "ZREVRANGEBYSCORE z (3 -inf LIMIT 0 2").unwrap()),
        ["b", "a"]
    );
    assert_eq!(
        strings(run(&mut db, "ZREVRANGEBYSCORE z +inf (2").unwrap()),
        ["d"]
    );
    assert_eq!(run(&mut db, "ZRANK z b").unwrap(), Value::Int(2));
    assert_eq!(run(&mut db, "ZSCORE z d").unwrap(), bulk(b"3"));
    assert_eq!(run(&mut db, "ZADD z 0.5 d").unwrap(), Value::Int(0));
    assert_eq!(run(&mut db, "ZADD z XX 1 new").unwrap(), Value::Int(0));
    assert_eq!(run(&mut db, "ZADD z NX 9 d").unwrap(), Value::Int(0));
    assert_eq!(run(&mut db, "ZADD z XX CH 7 d").unwrap(), Value::Int(1));
    assert_eq!(run(&mut db, "ZSCORE z new").unwrap(), Value::Nil);
    assert_eq!(run(&mut db, "ZADD z GT 0.5 d").unwrap(), Value::Int(0));
    assert_eq!(run(&mut db, "ZSCORE z d").unwrap(), bulk(b"7"));
    run(&mut db, "ZADD z 0.5 d").unwrap();
    assert_eq!(run(&mut db, "ZSCORE z d").unwrap(), bulk(b"0.5"));
    assert_eq!(run(&mut db, "ZREM z a b c d").unwrap(), Value::Int(4));
    assert_eq!(
        run(&mut db, "EXISTS z").unwrap(),
        Value::Int(0),
        "empty collections vanish"
    );
}

#[test]
fn lists_trim_and_range_with_negative_indexes() {
    let mut db = Db::default();
    run(&mut db, "RPUSH l a b c d e").unwrap();
    run(&mut db, "LTRIM l -3 -1").unwrap();
    assert_eq!(
        strings(run(&mut db, "LRANGE l 0 -1").unwrap()),
        ["c", "d", "e"]
    );
    assert_eq!(
        strings(run(&mut db, "LRANGE l 5 9").unwrap()),
        Vec::<String>::new()
    );
    run(&mut db, "LTRIM l 5 9").unwrap();
    assert_eq!(run(&mut db, "LLEN l").unwrap(), Value::Int(0));
}

#[test]
fn wrong_types_and_bad_numbers_are_refused_like_redis() {
    let mut db = Db::default();
    run(&mut db, "SET s x").unwrap();
    assert!(
        run(&mut db, "HGET s f")
            .unwrap_err()
            .0
            .starts_with("WRONGTYPE")
    );
    run(&mut db, "HSET h f x").unwrap();
    assert!(run(&mut db, "HINCRBY h f 1").is_err());
    assert!(run(&mut db, "HSET h f").is_err(), "odd field/value count");
    assert!(run(&mut db, "ZADD z nan m").is_err());
    assert!(
        run(&mut db, "FLUSHALL")
            .unwrap_err()
            .0
            .contains("not supported")
    );
}

#[test]
fn changes_are_recorded_in_replayable_form_and_reads_are_not() {
    let mut db = Db::default();
    run(&mut db, "SET k v PX 60000").unwrap();
    run(&mut db, "GET k").unwrap();
    run(&mut db, "ZREM nothing here").unwrap();
    run(&mut db, "HINCRBY h n 5").unwrap();
    let changes = db.take_changes();
    assert_eq!(changes.len(), 2);
    assert_eq!(
        changes[0][3], b"PXAT",
        "a relative expiry is logged as absolute"
    );
    let mut replayed = Db::default();
    for c in &changes {
        replayed.execute(c).unwrap();
    }
    assert_eq!(run(&mut replayed, "GET k").unwrap(), bulk(b"v"));
    assert_eq!(run(&mut replayed, "HGET h n").unwrap(), bulk(b"5"));
}

#[test]
fn writes_that_change_nothing_are_not_recorded() {
    let mut db = Db::default();
    run(&mut db, "ZADD z 1 a 2 b").unwrap();
    run(&mut db, "RPUSH l x y").unwrap();
    run(&mut db, "HSET h f v").unwrap();
    db.take_changes();
    // Same scores, members kept by NX/GT, a trim that keeps all, the same value.
    run(&mut db, "ZADD z 1 a 2 b").unwrap();
    run(&mut db, "ZADD z NX 5 a").unwrap();
    run(&mut db, "ZADD z GT 0 b").unwrap();
    run(&mut db, "ZADD z XX 3 missing").unwrap();
    run(&mut db, "LTRIM l -200 -1").unwrap();
    run(&mut db, "HSET h f v").unwrap();
    assert!(db.take_changes().is_empty());
    run(&mut db, "ZADD z GT 3 b").unwrap();
    run(&mut db, "LTRIM l -1 -1").unwrap();
    assert_eq!(db.take_changes().len(), 2);
}

#[test]
fn a_dump_recreates_every_key() {
    let mut db = Db::default();
    for line in [
        "SET a 1",
        "HSET h f v g w",
        "RPUSH l x y",
        "SADD s m",
        "ZADD z 1.25 m 2 n",
    ] {
        run(&mut db, line).unwrap();
    }
    let mut copy = Db::default();
    for c in db.dump() {
        copy.execute(&c).unwrap();
    }
    assert_eq!(copy.dump(), db.dump());
    assert_eq!(copy.key_count(), 5);
}

#[test]
fn expired_keys_are_gone() {
    let mut db = Db::default();
    run(&mut db, "SET k v PXAT 1").unwrap();
    assert_eq!(run(&mut db, "GET k").unwrap(), Value::Nil);
    assert_eq!(
        strings(run(&mut db, "KEYS *").unwrap()),
        Vec::<String>::new()
    );
}

#[test]
fn glob_patterns_match_like_redis() {
    assert!(glob(b"tq:{d}:job:*", b"tq:{d}:job:j1"));
    assert!(!glob(b"tq:{d}:job:*", b"tq:{e}:job:j1"));
    assert!(glob(b"a?c", b"abc"));
    assert!(glob(b"a[bx]c", b"axc"));
    assert!(glob(b"a\\*", b"a*"));
}
