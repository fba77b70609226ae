//! Hostile write lists, both ways (`protocol`, "Write lists").
//!
//! Against a real owner, lists sent by hand: each entry is judged as a
//! single write at its place in the payload (a bad one refused alone, with
//! its code; the good ones land, from their own bytes); lengths that do not
//! add up to the payload refuse every entry with code 1 and change
//! nothing; a header that does not parse is dropped unanswered, and the
//! owner keeps serving. Against a real writer, a raw owner: a batch's small
//! puts arrive as one list that is exactly the puts, and no put reports
//! `Ok` unless its status byte said 0 in a reply of one byte per entry on
//! the list's id.

mod against_a_writer;
mod against_an_owner;
