mod errors;
mod heap_profile;
mod locations;
mod over_time;
mod overhead;
