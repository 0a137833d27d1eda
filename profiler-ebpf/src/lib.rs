#![no_std]
// Empty: the programs live in the binary target, see main.rs.
